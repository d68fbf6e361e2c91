"""A causal language model in plain PyTorch (no transformers, no config.json): what a user of
the Python API may bring. A GRU over token embeddings with an output layer, and a ``generate``
that samples token by token from the carried hidden state. It ignores ``attention_mask``, as a
naive user model would: the plain PyTorch engine feeds it the same left-padded layout when it
generates and when it trains (verl.rollout.module_engine)."""

from __future__ import annotations

import torch


class TinyGRULM(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden: int = 64, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab_size, hidden)
        self.rnn = torch.nn.GRU(hidden, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab_size)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(input_ids))
        return self.head(out)  # [B, T, V]

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 16,
        do_sample: bool = True,
        temperature: float = 1.0,
        eos_token_id: int | None = None,
    ) -> torch.Tensor:
        out, h = self.rnn(self.embed(input_ids))
        logits = self.head(out[:, -1])
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        new = []
        for _ in range(max_new_tokens):
            if do_sample:
                token = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1).squeeze(-1)
            else:
                token = logits.argmax(-1)
            if eos_token_id is not None:
                token = torch.where(done, torch.full_like(token, eos_token_id), token)
                done |= token == eos_token_id
            new.append(token)
            if bool(done.all()):
                break
            out, h = self.rnn(self.embed(token.unsqueeze(1)), h)
            logits = self.head(out[:, -1])
        return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)
