"""``device_map``: the placements the trainer can run (roles colocated on devices 0..N-1, one rank
each, or on devices of their own: ``trainer.placement``) become its config; every other map fails
naming the role, its devices and the fix. No trainer is built: the map is checked when the stream
is made (tests/trainer/test_placement.py runs roles apart)."""

from __future__ import annotations

import pytest

from verl.operator import DataStream, RolloutOperator
from verl.parallel.device_map import ROLE_NAMES, DevicePlacement, resolve_device_map
from verl.parallel.topology import ROLES

TUTORIAL = {"actor": [0, 1], "reward_model": [2], "rollout_sampler": [0, 1]}


def test_every_accepted_role_name_is_a_trainer_role():
    assert set(ROLE_NAMES.values()) == set(ROLES)
    assert {"actor", "rollout_sampler", "reference", "critic", "reward_model"} <= set(ROLE_NAMES)


def test_a_colocated_map_sets_the_trainer_placement():
    expected = DevicePlacement(device="cuda", devices=(0, 1), roles=("actor", "rollout", "ref"))
    for device_map in (
        {"actor": [0, 1], "rollout_sampler": [1, 0], "reference": (0, 1)},  # order does not matter
        {"actor": ["cuda:0", "cuda:1"], "rollout": [0, 1], "ref": ["cuda:1", 0]},
    ):
        actual = resolve_device_map(device_map, world_size=2, cuda_devices=4)
        assert actual == expected
    assert expected.config_overrides() == {"trainer.device": "cuda", "trainer.n_gpus_per_node": 2, "trainer.nnodes": 1}
    # No CUDA device, or trainer.device=cpu: ints are CPU ranks; "cpu" is every rank of the world.
    assert resolve_device_map({"actor": [0, 1]}, world_size=2, cuda_devices=0).device == "cpu"
    assert resolve_device_map({"actor": [0, 1]}, world_size=2, cuda_devices=2, device="cpu").device == "cpu"
    cpu = resolve_device_map({"actor": "cpu", "rm": ["cpu:0", "cpu:1", "cpu:2"]}, world_size=3, cuda_devices=1)
    assert (cpu.device, cpu.devices, cpu.roles) == ("cpu", (0, 1, 2), ("actor", "reward_model"))


def test_roles_on_devices_of_their_own_become_the_trainer_placement():
    # The tutorials' map: the reward model on a GPU of its own, the rollout with the actor.
    tutorial = resolve_device_map(TUTORIAL, world_size=3, cuda_devices=3)
    assert tutorial.role_devices == {"actor": [0, 1], "reward_model": [2]}
    assert tutorial.config_overrides() == {
        "trainer.device": "cuda", "trainer.n_gpus_per_node": 3, "trainer.nnodes": 1,
        "trainer.placement": {"actor": [0, 1], "reward_model": [2]},
    }
    assert tutorial.describe() == (
        "actor on cuda [0, 1]; reward_model on cuda [2]; the rollout engine and the roles left out with the actor "
        "(devices cuda:0, cuda:1, cuda:2)"
    )
    # A role named alone takes its devices; the actor (left out) the rest; the rollout names the actor's.
    assert resolve_device_map({"critic": [1]}, world_size=2, cuda_devices=0).role_devices == {"critic": [1], "actor": [0]}
    assert resolve_device_map({"actor": [0], "rollout": [0], "ref": [1]}, world_size=2, cuda_devices=0).role_devices == {
        "actor": [0], "ref": [1]
    }
    # Generation disaggregated: the rollout engine on a device of its own.
    apart = resolve_device_map({"actor": [0], "rollout_sampler": [1]}, world_size=2, cuda_devices=0)
    assert apart.config_overrides()["trainer.placement"] == {"actor": [0], "rollout": [1]}


def test_a_stream_puts_roles_apart_through_the_config(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # the world a torchrun launch of 2 would give the stream
    stream = DataStream(
        model="unused", train_files="unused.parquet", overrides=["trainer.device=cpu", "actor_rollout_ref.rollout.name=hf"],
        device_map={"actor": [0], "critic": [1]},
    ).add_operator(RolloutOperator())
    cfg = stream.config()
    assert (cfg.trainer.n_gpus_per_node, dict(cfg.trainer.placement)) == (2, {"actor": [0], "critic": [1]})


def test_a_stream_builds_its_config_from_the_map():
    stream = DataStream(
        model="unused", train_files="unused.parquet", overrides=["trainer.device=cpu", "actor_rollout_ref.rollout.name=hf"],
        device_map={"actor": [0], "rollout_sampler": "cpu"},
    ).add_operator(RolloutOperator())
    assert stream.placement.describe() == "every role colocated on cpu:0 (device_map named actor, rollout)"
    cfg = stream.config()  # the trainer would be built from this: no trainer here
    assert (cfg.trainer.device, cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes) == ("cpu", 1, 1)
    with pytest.raises(ValueError, match=r"device_map sets .*trainer.n_gpus_per_node=1.*but overrides set trainer.n_gpus_per_node=2"):
        DataStream(model="unused", overrides=["trainer.device=cpu", "trainer.n_gpus_per_node=2"], device_map={"actor": "cpu"})


@pytest.mark.parametrize(
    ("device_map", "world", "cuda", "message"),
    [
        # More devices than exist: the role, its ids and what exists.
        (TUTORIAL, 1, 0, r"device_map\['actor'\] = \[0, 1\] names cpu device\(s\) \[1\] that do not exist: the launched "
         r"world has 1 CPU rank\(s\) \(0\.\.0\); more need torchrun --nproc_per_node=2"),
        (TUTORIAL, 3, 2, r"device_map\['reward_model'\] = \[2\] names cuda device\(s\) \[2\] that do not exist: this "
         r"machine has 2 CUDA device\(s\) \(0\.\.1\)"),
        ({"actor": "cuda:0"}, 1, 0, r"asks for CUDA devices .* but none is visible here; map to 'cpu'"),
        # Roles on devices of their own: the rollout stays with the actor; roles share devices whole or not at all.
        ({"actor": [0, 1], "rollout_sampler": [1]}, 2, 2, r"puts the actor on every device \(\[0, 1\]\) and rollout "
         r"on \[1\]: roles share devices whole or not at all"),
        ({"actor": [0, 1], "reward_model": [1]}, 2, 2, r"puts the actor on every device \(\[0, 1\]\) and reward_model "
         r"on \[1\]: roles share devices whole or not at all; give the actor the devices no other role has, e\.g\. \[0\]"),
        ({"actor": [0], "critic": [1, 2], "rm": [2, 3]}, 4, 4, r"puts critic on cuda \[1, 2\] and reward_model on "
         r"\[2, 3\]: they share \[2\] but not all"),
        ({"actor": [2, 3]}, 2, 4, r"rank i of a node runs on device i .* CUDA_VISIBLE_DEVICES=2,3 and map to \[0, 1\]"),
        ({"actor": [0, 1]}, 1, 2, r"on 2 cuda device\(s\) \[0, 1\], one rank each, but the launched world has 1 "
         r"process\(es\); launch 2 with torchrun --nproc_per_node=2, or map to \[0\]"),
        # Malformed maps.
        ({"actr": [0]}, 1, 0, r"unknown role 'actr' \(did you mean 'actor'\?\); the roles are \["),
        ({"rollout": [0], "rollout_sampler": [0]}, 1, 0, r"names the rollout role twice \('rollout' and 'rollout_sampler'\)"),
        ({"actor": "gpu:0"}, 1, 0, r"device_map\['actor'\]: 'gpu:0' is not a device; use an int \(0\), 'cuda:0', 'cpu:0' or 'cpu'"),
        ({"actor": [True]}, 1, 0, r"True is not a device"),
        ({"actor": [-1]}, 1, 0, r"device -1 is negative"),
        ({"actor": []}, 1, 0, r"device_map\['actor'\] is empty"),
        ({"actor": [0, 0]}, 2, 0, r"device_map\['actor'\] = \[0, 0\] lists a device twice"),
        ({"actor": ["cpu", "cpu:0"]}, 1, 0, r"'cpu' already means every CPU rank"),
        ({"actor": "cuda:0", "critic": "cpu"}, 1, 1, r"mixes CUDA and CPU devices"),
        ({}, 1, 0, r"device_map must be a non-empty dict of role -> devices"),
        ([0, 1], 1, 0, r"device_map must be a non-empty dict of role -> devices"),
    ],
)
def test_a_map_the_trainer_cannot_place_fails_naming_the_fix(device_map, world, cuda, message):
    with pytest.raises(ValueError, match=message):
        resolve_device_map(device_map, world_size=world, cuda_devices=cuda)


def test_the_map_must_agree_with_trainer_device():
    with pytest.raises(ValueError, match=r"names cuda devices .* but trainer.device=cpu; map to cpu devices"):
        resolve_device_map({"actor": ["cuda:0"]}, world_size=1, cuda_devices=1, device="cpu")
    with pytest.raises(ValueError, match=r"names cuda devices .* but trainer.device=cpu"):
        DataStream(model="unused", overrides=["trainer.device=cpu"], device_map={"actor": "cuda:0"})
