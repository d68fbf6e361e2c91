"""A vision-language model on the Megatron engine (#53): ``MegatronEngine`` builds the tiny Qwen2.5-VL
(``verl.models.megatron_vlm``) from its Hugging Face directory, as actor and reference.

The batch is the transformers rollout engine's samples of prompts with images of different sizes (the
FSDP2 tests' fixture): the engine's log-probabilities equal the rollout's and the FSDP2 engine's; the
first update's ratio is exactly 1 and the reference's KL exactly 0; the vision tower trains or stays
frozen; a checkpoint resumes it (weights and optimizer state); ``export_hf`` writes a directory
transformers loads with the same outputs; the push into the transformers rollout engine leaves the
engine holding the actor's weights, the tower's included.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.trainer.test_vlm_fsdp import RESPONSE, _png, rollout  # noqa: F401 - a fixture (of this module's vlm_dir)
from verl.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    """The tiny Qwen2.5-VL with two key/value heads: tensor parallel 2 splits them."""
    from verl.data.tiny_vlm import TinyVLMSpec, make_tiny_vlm

    return make_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "model"), TinyVLMSpec(corpus_lines=500, kv_heads=2))

# fp32 on both sides; the same math in another order (fused QKV, TP-split matmuls, Megatron's and
# transformers' rotary code, the rollout's cached decode): rounding, measured 9.5e-7 at most (TP 2 and DP 2,
# against transformers and the rollout; the export 4.8e-7). A missing image or a wrong position is > 1e-3.
ATOL = 1e-5


def _engine(vlm_dir: str, pg, *, trainable: bool, freeze: bool = False, pp: int = 1):
    from verl.config import OptimConfig
    from verl.config.schema import MegatronConfig, ModelConfig
    from verl.engine import MegatronEngine

    # Adam: a resumed run that lost the moments would take another second step.
    optim = OptimConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, weight_decay=0.0) if trainable else None
    return MegatronEngine(model=ModelConfig(path=vlm_dir), megatron=MegatronConfig(pipeline_model_parallel_size=pp),
                          pg=pg, optim=optim,
                          total_training_steps=4, freeze_vision_tower=freeze)


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.hf_weights()}


def _engine_body(vlm_dir: str, batch: dict[str, torch.Tensor], tp: int, freeze: bool, root: str, pp: int) -> dict:
    """Actor and reference on ``tp`` x ``pp`` x (2 / tp / pp) ranks; forward, one update, save/load, export, push."""
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config.schema import RolloutConfig
    from verl.engine import LossShare
    from verl.hybrid.hf_push import GatheredHFPush
    from verl.parallel import megatron_state as ms
    from verl.rollout.hf_engine import HFRollout

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=7)
    try:
        actor = _engine(vlm_dir, pg, trainable=True, freeze=freeze, pp=pp)
        ref = _engine(vlm_dir, pg, trainable=False, pp=pp)
        full = actor.forward(batch, micro_batch_size=3).outputs["logprobs"][:, -RESPONSE:]  # the whole batch
        dp, rank = pg.dp.size(), pg.dp.rank()
        per = batch["input_ids"].shape[0] // dp
        local = {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}
        old = actor.forward(local, micro_batch_size=2).outputs["logprobs"][:, -RESPONSE:]
        ref_lp = ref.forward(local, micro_batch_size=2).outputs["logprobs"][:, -RESPONSE:]
        info = GlobalBatchInfo.from_masks([local["response_mask"].float()], group=pg.dp if dp > 1 else None)

        def loss_fn(outputs, mb):  # the first update's new log-probs against the old: its ratio's departure from 1
            new = outputs["logprobs"][:, -RESPONSE:]
            ratio = torch.exp(new - mb["old"])
            departure = ((ratio - 1).abs() * mb["response_mask"]).max()
            return LossShare(agg_loss(-ratio * mb["adv"], mb["response_mask"], "token-mean", global_batch_info=info),
                             {"max:ratio_departure": departure.detach()})

        gen = torch.Generator().manual_seed(11)
        adv = torch.randn(batch["input_ids"].shape[0], 1, generator=gen).expand(-1, RESPONSE)[rank * per:(rank + 1) * per]
        before = _weights(actor)
        result = actor.train_step({**local, "old": old, "adv": adv.contiguous()}, micro_batch_size=2, loss_fn=loss_fn)
        after = _weights(actor)
        vision = actor.chunks[0].module.vision  # on the first pipeline stage only
        tower = set() if vision is None else {id(p) for p in vision.parameters()}
        optimized = sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"] if id(p) in tower)
        actor.save(os.path.join(root, "ckpt"))
        # The push into a transformers rollout engine (its own copy of the initial weights).
        hf = HFRollout(RolloutConfig(name="hf", prompt_length=48, response_length=RESPONSE), vlm_dir, device="cpu")
        push = GatheredHFPush(actor, hf, bucket_bytes=1 << 16)
        metrics = push.push()
        pushed = {n: p.detach().clone() for n, p in hf.model.named_parameters()}
        actor.export_hf(os.path.join(root, "export"))
        exported_lp = actor.forward(batch, micro_batch_size=3).outputs["logprobs"][:, -RESPONSE:]
        # A second step, then the same second step on a fresh engine resumed from the checkpoint.
        second = {**local, "old": old, "adv": adv.contiguous()}
        actor.train_step(second, micro_batch_size=2, loss_fn=loss_fn)
        continued = _weights(actor)
        resumed = _engine(vlm_dir, pg, trainable=True, freeze=freeze, pp=pp)
        resumed.load(os.path.join(root, "ckpt"))
        loaded = _weights(resumed)
        resumed.train_step(second, micro_batch_size=2, loss_fn=loss_fn)
        return {
            "full": full, "old": old, "ref": ref_lp, "departure": result.metrics["max:ratio_departure"],
            "before": before, "after": after, "continued": continued, "loaded": loaded,
            "resumed": _weights(resumed), "pushed": pushed, "names": push.names, "buckets": metrics["update_weights/buckets"],
            "optimized": optimized, "exported_lp": exported_lp, "steps": resumed.steps_taken, "pp": pg.pp.size(),
        }
    finally:
        ms.destroy_model_parallel()


def _hf_logprobs(model_dir: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from transformers import AutoModelForImageTextToText

    from tests.models.tiny import reference_logprobs_entropy
    from verl.protocol.images import model_image_inputs

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    images = model_image_inputs(batch)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                       **images).logits
    return reference_logprobs_entropy(logits, ids, mask)[0][:, -RESPONSE:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp,freeze", [(2, 1, False), (1, 1, True), (1, 2, False)],
                         ids=["tp2-trained-tower", "dp2-frozen-tower", "pp2-trained-tower"])
def test_megatron_engine_trains_a_vlm(vlm_dir, rollout, tmp_path, tp, pp, freeze):
    from verl.models.megatron_vlm import VISION_PREFIX

    batch = {k: v for k, v in rollout.items() if k != "rollout_log_probs"}
    results = run_distributed(_engine_body, 2, vlm_dir, batch, tp, freeze, str(tmp_path), pp, timeout=560)
    mask = rollout["response_mask"].bool()
    expected = _hf_logprobs(vlm_dir, batch)  # transformers' one pass (the FSDP2 engine runs this very model)
    r0 = results[0]
    assert [r["pp"] for r in results] == [pp, pp]
    # Log-probs of a batch with images of two sizes (28 x 28, 56 x 56, 42 x 56, 56 x 28): the engine's equal
    # transformers' and the rollout's (its cached decode) within fp32 rounding.
    assert (r0["full"] - expected).abs()[mask].max() <= ATOL
    assert (r0["full"] - rollout["rollout_log_probs"]).abs()[mask].max() <= ATOL
    for r in results:
        # Step 1: the update's first pass and the old log-probs come from the same weights: ratio exactly 1;
        # the reference starts from them: KL exactly 0 (bit-equal log-probs).
        assert r["departure"] == 0.0
        assert torch.equal(r["ref"], r["old"])
        assert r["steps"] == 2
    vision = [n for n in r0["before"] if n.startswith(VISION_PREFIX)]
    # The optimizer updates the tower's parameters, unless frozen (no optimizer state then).
    assert vision and r0["optimized"] == (0 if freeze else sum(r0["before"][n].numel() for n in vision))
    moved = [n for n in vision if not torch.equal(r0["after"][n], r0["before"][n])]
    assert moved == ([] if freeze else vision)
    assert not torch.equal(r0["after"]["lm_head.weight"], r0["before"]["lm_head.weight"])
    for r in results:  # every rank: the same whole weights, the tower's too
        for name, value in r0["after"].items():
            # TP ranks gather the same shards; DP ranks all-reduce the same sums (measured bit-equal); 1e-6
            # leaves room for a reduction order that differs by rank.
            torch.testing.assert_close(r["after"][name], value, rtol=0, atol=1e-6, msg=name)
        # The checkpoint resumes the weights and the optimizer state (Adam's moments): the same second step.
        for name, value in r["continued"].items():
            assert torch.equal(r["loaded"][name], r["after"][name]), name
            assert torch.equal(r["resumed"][name], value), name
        # After the push the rollout engine holds the actor's weights, the vision tower included.
        for name, value in r["after"].items():
            assert torch.equal(r["pushed"][r["names"][name]], value), name
        assert r["buckets"] > 1
    # export_hf: a directory transformers loads, with the engine's outputs and its image processor.
    export = str(tmp_path / "export")
    assert os.path.isfile(os.path.join(export, "preprocessor_config.json"))
    assert (_hf_logprobs(export, batch) - r0["exported_lp"]).abs()[mask].max() <= ATOL


def _packed_body(vlm_dir: str, batch: dict[str, torch.Tensor]) -> dict:
    """At TP 2: the padded engine and the engine with sequence parallel and packed sequences, each a
    forward of the whole batch and one SGD step of the same loss."""
    from verl.algos import GlobalBatchInfo, agg_loss
    from verl.config import OptimConfig
    from verl.config.schema import MegatronConfig, ModelConfig
    from verl.engine import LossShare, MegatronEngine
    from verl.parallel import megatron_state as ms

    pg = ms.initialize_model_parallel(tensor_model_parallel_size=2, seed=7)
    adv = torch.randn(batch["input_ids"].shape[0], 1, generator=torch.Generator().manual_seed(11)).expand(-1, RESPONSE)
    info = GlobalBatchInfo.from_masks([batch["response_mask"].float()])
    out = {}
    try:
        for name, packed in (("padded", False), ("packed", True)):
            engine = MegatronEngine(
                model=ModelConfig(path=vlm_dir, use_remove_padding=packed),
                megatron=MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=packed), pg=pg,
                optim=OptimConfig(optimizer="sgd", lr=1e-2, clip_grad=0.0, weight_decay=0.0), total_training_steps=2,
            )
            # Micro-batches of 3 rows, each with images of two sizes.
            old = engine.forward(batch, micro_batch_size=3).outputs["logprobs"][:, -RESPONSE:]

            def loss_fn(outputs, mb):
                ratio = torch.exp(outputs["logprobs"][:, -RESPONSE:] - mb["old"])
                departure = ((ratio - 1).abs() * mb["response_mask"]).max()
                loss = agg_loss(-ratio * mb["adv"], mb["response_mask"], "token-mean", global_batch_info=info)
                return LossShare(loss, {"max:ratio_departure": departure.detach()})

            before = _weights(engine)
            step = {**batch, "old": old, "adv": adv.contiguous()}
            result = engine.train_step(step, micro_batch_size=4, loss_fn=loss_fn)
            after = _weights(engine)
            out[name] = {"old": old, "departure": result.metrics["max:ratio_departure"], "after": after,
                         "moved": sorted(n for n, v in after.items() if not torch.equal(v, before[n]))}
            del engine
        return out
    finally:
        ms.destroy_model_parallel()


@pytest.mark.timeout(600)
def test_sequence_parallel_and_packed_sequences_on_the_engine(vlm_dir, rollout):
    """``use_remove_padding=true`` with ``sequence_parallel=true`` at TP 2: the images reach each packed
    micro-batch (3 rows of images of different sizes per micro-batch); log-probabilities equal the padded
    engine's and transformers', the first step's ratio is exactly 1, and one SGD step gives the padded
    engine's weights (the vision tower's included: its gradient comes through the packed row and the
    sequence-parallel split)."""
    from verl.models.megatron_vlm import VISION_PREFIX

    batch = {k: v for k, v in rollout.items() if k != "rollout_log_probs"}
    results = run_distributed(_packed_body, 2, vlm_dir, batch, timeout=560)
    mask = rollout["response_mask"].bool()
    expected = _hf_logprobs(vlm_dir, batch)
    for r in results:
        padded, packed = r["padded"], r["packed"]
        # Packed rows and per-sequence attention against padded rows, TP-split matmuls with and without the
        # sequence-parallel gathers: the same fp32 math in another order (ATOL's comment; a missing image
        # or a packed sequence given another row's positions is > 1e-3).
        assert (packed["old"] - padded["old"]).abs()[mask].max() <= ATOL
        assert (packed["old"] - expected).abs()[mask].max() <= ATOL
        assert packed["departure"] == 0.0
        vision = [n for n in padded["after"] if n.startswith(VISION_PREFIX)]
        assert vision
        for name, value in padded["after"].items():
            # lr 1e-2 times gradients that agree to fp32 rounding (~1e-6 relative): the weights to ~1e-8.
            torch.testing.assert_close(packed["after"][name], value, rtol=0, atol=1e-6, msg=name)
        # The same tensors moved, the tower's among them, so the comparison above covers its gradient.
        assert packed["moved"] == padded["moved"]
        assert len(set(vision) & set(packed["moved"])) > len(vision) // 2


def _refused(vlm_dir: str, **changes) -> str:
    from verl.config.schema import MegatronConfig, ModelConfig
    from verl.engine import MegatronEngine
    from verl.parallel import megatron_state as ms

    layout = {k: changes.pop(k) for k in ("pipeline_model_parallel_size", "context_parallel_size") if k in changes}
    vpp = {k: changes.pop(k) for k in ("virtual_pipeline_model_parallel_size",) if k in changes}
    pg = ms.initialize_model_parallel(**layout)
    try:
        MegatronEngine(model=ModelConfig(path=vlm_dir, **changes), megatron=MegatronConfig(**layout, **vpp), pg=pg)
    except ValueError as exc:
        return str(exc)
    finally:
        ms.destroy_model_parallel()
    return "built"


@pytest.mark.timeout(300)
def test_what_the_engine_does_not_run_is_refused_before_the_build(vlm_dir):
    vpp = run_distributed(_refused, 2, vlm_dir, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)[0]
    assert "\n" not in vpp and "virtual_pipeline_model_parallel_size=2 (pipeline 2): set it to null" in vpp
    assert "Qwen2.5-VL" in vpp
    cp = run_distributed(_refused, 2, vlm_dir, context_parallel_size=2)[0]
    assert "context_parallel_size=2: set it to 1" in cp
    lora = run_distributed(_refused, 1, vlm_dir, lora_rank=4)[0]
    assert "lora_rank=4" in lora


def _grpo_body(vlm_dir: str, train_file: str, root: str) -> dict:
    import json

    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(
        PPOConfig,
        config_file="grpo_tiny_cpu",
        overrides=[
            f"actor_rollout_ref.model.path={vlm_dir}", f"data.train_files={train_file}", "data.val_files=null",
            "data.max_prompt_length=48", "data.max_response_length=8", "data.train_batch_size=4",
            "actor_rollout_ref.model.use_remove_padding=false", "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.entropy_coeff=0.01",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_hf=false",
            "trainer.n_gpus_per_node=2", "trainer.logger=[jsonl]", "trainer.total_training_steps=2",
            f"trainer.default_local_dir={root}", f"trainer.log_dir={root}/logs",
        ],
        world_size=2,
    )
    with PPOTrainer(cfg) as trainer:
        trainer.fit()
        engines = [type(r.role.engine).__name__ for r in (trainer.world.actor, trainer.world.reference)]
    with open(f"{root}/logs/metrics.jsonl", encoding="utf-8") as f:
        return {"steps": [json.loads(line) for line in f], "engines": engines}


@pytest.mark.timeout(600)
def test_grpo_with_images_on_the_megatron_actor(vlm_dir, tmp_path):
    """Two GRPO steps through the trainer's pipeline (2 ranks, actor and reference on Megatron at TP 2, the
    transformers rollout fed by the push): step 1's ratio is exactly 1 and its KL 0; the rollout's
    log-probabilities are the actor's at both steps (step 2: after the push of the updated weights)."""
    rows = [{"prompt": f"<image>Which colour? {i}", "images": [{"bytes": _png(c, (28, 28) if i % 2 else (56, 56)),
                                                                  "path": None}],
             "data_source": "hiyouga/geometry3k", "reward_model": {"style": "rule", "ground_truth": c}}
            for i, c in enumerate(["red", "blue", "green", "red", "blue", "green", "red", "blue"])]
    train = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), train)
    out = run_distributed(_grpo_body, 2, vlm_dir, train, str(tmp_path / "run"), timeout=580)[0]
    assert out["engines"] == ["MegatronEngine", "MegatronEngine"]
    first, second = out["steps"][0], out["steps"][1]
    assert first["actor/ppo_kl"] == 0.0 and first["actor/kl_loss"] == 0.0
    for step in (first, second):
        # The engine's cached decode and the trainer's one pass in fp32: rounding only (text models' bound).
        assert step["training/rollout_logprob_diff_max"] < 1e-4, step["training/rollout_logprob_diff_max"]
    assert second["actor/kl_loss"] != 0.0  # the actor moved, and the rollout followed it


def test_the_engine_s_spec_of_a_vlm_directory_is_its_decoder_s(vlm_dir):
    """What the layout checks, the MFU figures and the memory plan read (``load_model_spec``); the
    decoder's override is refused in one line rather than dropped."""
    from verl.config.schema import ModelConfig
    from verl.engine.build import load_model_spec

    spec = load_model_spec(ModelConfig(path=vlm_dir))
    assert (spec.model_type, spec.hidden_size, spec.num_layers, spec.num_kv_heads, spec.qkv_bias) == ("qwen2", 64, 2, 2, True)
    with pytest.raises(ValueError, match=r"^model.override_config=\{'rms_norm_eps': 1e-05\}: not applied to a vision-language"):
        load_model_spec(ModelConfig(path=vlm_dir, override_config={"rms_norm_eps": 1e-5}))


def test_a_rollout_apart_from_the_megatron_vlm_actor_is_refused_before_the_build(vlm_dir, tmp_path):
    """The push into a rollout apart carries the decoder alone: refused at pre-flight in one line naming
    the key and the fix; FSDP2's actor and the colocated rollout pass that check."""
    from verl.config import PPOConfig, load_config
    from verl.trainer.ppo_checks import _megatron_vlm_problems, check_ppo_inputs

    rows = [{"prompt": "<image>Which colour?", "images": [{"bytes": _png("red", (28, 28)), "path": None}],
             "data_source": "hiyouga/geometry3k", "reward_model": {"style": "rule", "ground_truth": "red"}}]
    train = str(tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows), train)
    base = [f"actor_rollout_ref.model.path={vlm_dir}", f"data.train_files={train}", "data.val_files=null",
            "actor_rollout_ref.rollout.name=hf", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.strategy=megatron",
            "trainer.rollout_mode=async", f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs"]

    def config(*more):
        return load_config(PPOConfig, config_file="grpo_tiny_cpu", overrides=[*base, *more], world_size=2)

    with pytest.raises(ValueError) as err:
        check_ppo_inputs(config("trainer.placement.rollout=[1]"))
    line = next(p for p in str(err.value).splitlines() if "trainer.placement.rollout" in p)
    assert "trainer.placement.rollout=[1]: the Megatron actor of the vision-language model" in line
    assert line.rstrip().endswith("drop trainer.placement.rollout (docs/vlm.md)")
    assert _megatron_vlm_problems(config()) == []  # colocated
    assert _megatron_vlm_problems(config("trainer.placement.rollout=[1]", "actor_rollout_ref.actor.strategy=fsdp2")) == []
