"""A small generated English corpus for training tiny tokenizers offline.

Nothing is downloaded: sentences come from a seeded grammar over a few hundred common
words, mixed with the arithmetic task's prompts and answers and short math-word-problem
phrasing, so a tokenizer trained on it covers everyday English, digits and the task text.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

_NAMES = (
    "Alice Ben Carla David Emma Farid Grace Hugo Ines Jamal Kira Leo Maya Nina Omar Priya "
    "Quinn Rosa Sam Tara Umar Vera Will Xena Yusuf Zoe"
).split()
_NOUNS = (
    "apple book bottle bridge cake car cat chair city cloud coin cup day dog door egg field "
    "flower friend garden glass hill horse house idea island key lamp letter market moon "
    "morning mountain night ocean orange paper pencil picture plan question river road room "
    "school ship shop song star stone story street sun table teacher tree train valley "
    "village wall window winter word world year answer number problem box basket marble "
    "ticket student family farmer baker week hour minute dollar"
).split()
_ADJECTIVES = (
    "big small old new red blue green bright dark quiet loud warm cold happy tired careful "
    "quick slow heavy light simple strange early late round sharp soft clean busy empty full"
).split()
_VERBS_PAST = (
    "saw found made took gave bought sold built painted opened closed carried counted "
    "wrote read moved cleaned visited watched shared planted cooked fixed lost kept"
).split()
_VERBS_PRESENT = (
    "sees finds makes takes gives buys sells builds paints opens closes carries counts "
    "writes reads moves cleans visits watches shares plants cooks fixes keeps"
).split()
_ADVERBS = "slowly quickly carefully quietly happily always often never sometimes again".split()
_PLACES = (
    "in the garden|at the market|near the river|on the hill|in the kitchen|at school|"
    "by the window|in the city|under the tree|on the road|across the bridge|at home"
).split("|")
_TIMES = (
    "yesterday|today|last week|in the morning|at night|on Monday|every day|after lunch|"
    "before dinner|this year|in winter|at noon"
).split("|")
_CONNECTIVES = ("and then", "because", "so", "but", "while", "after that", "although")


def _noun_phrase(rng: random.Random) -> str:
    noun = rng.choice(_NOUNS)
    if rng.random() < 0.5:
        noun = f"{rng.choice(_ADJECTIVES)} {noun}"
    return f"{rng.choice(('the', 'a', 'her', 'his', 'their', 'one'))} {noun}"


def _clause(rng: random.Random) -> str:
    subject = rng.choice(_NAMES)
    if rng.random() < 0.5:
        verb = rng.choice(_VERBS_PAST)
        tail = rng.choice(_TIMES) if rng.random() < 0.5 else rng.choice(_PLACES)
    else:
        verb = rng.choice(_VERBS_PRESENT)
        tail = rng.choice(_PLACES)
    adverb = f" {rng.choice(_ADVERBS)}" if rng.random() < 0.3 else ""
    return f"{subject}{adverb} {verb} {_noun_phrase(rng)} {tail}"


def english_sentence(rng: random.Random) -> str:
    """One grammatical English sentence (statement, compound sentence or question)."""
    kind = rng.random()
    if kind < 0.55:
        text = _clause(rng) + "."
    elif kind < 0.85:
        text = f"{_clause(rng)} {rng.choice(_CONNECTIVES)} {_clause(rng)}."
    else:
        verb = rng.choice(("see", "find", "make", "take", "buy"))
        text = f"Why did {rng.choice(_NAMES)} {verb} {_noun_phrase(rng)}?"
    return text[0].upper() + text[1:]


def word_problem(rng: random.Random) -> str:
    """A short math word problem with its worked answer (GSM8K-like phrasing)."""
    name = rng.choice(_NAMES)
    thing = rng.choice(("apples", "books", "coins", "marbles", "tickets", "flowers", "eggs"))
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    if rng.random() < 0.5:
        return (
            f"{name} has {a} {thing} and buys {b} more. How many {thing} does {name} have now? "
            f"{name} has {a} + {b} = {a + b} {thing}. #### {a + b}"
        )
    c = rng.randint(2, 9)
    return (
        f"{name} has {c} boxes with {a} {thing} in each box. How many {thing} are there in all? "
        f"There are {c} * {a} = {c * a} {thing}. #### {c * a}"
    )


def generate_corpus(num_lines: int = 4000, seed: int = 0) -> Iterator[str]:
    """Yield ``num_lines`` lines of generated text: English, word problems and task prompts.

    The mix (about 60% English, 20% word problems, 20% arithmetic prompt/answer pairs) is
    fixed so the same seed always gives the same text.
    """
    from verl.data.tasks.arithmetic import make_problem

    rng = random.Random(seed)
    for _ in range(num_lines):
        r = rng.random()
        if r < 0.6:
            yield " ".join(english_sentence(rng) for _ in range(rng.randint(1, 4)))
        elif r < 0.8:
            yield word_problem(rng)
        else:
            problem = make_problem(rng, digits=rng.randint(1, 4), ops=("+", "-", "*"))
            # The chat roles as the ChatML template writes them, so they become single tokens.
            yield f"user\n{problem.question}\nassistant\n{problem.response}\n"
