"""GPU presets for the memory plan and the step-time estimate, each figure with its source.

Figures are the vendors' published peak numbers (dense bf16 tensor-core throughput, HBM bandwidth
and capacity, NVLink and per-GPU InfiniBand bandwidth of the reference DGX/HGX systems). The step-
time estimate scales them by the efficiencies in ``verl.planning.steptime``; nothing here is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU_PRESETS", "GPUPreset", "gpu_preset"]


@dataclass(frozen=True, kw_only=True)
class GPUPreset:
    """One accelerator's published figures."""

    name: str
    memory_gib: float
    """Memory capacity in GiB (2**30 bytes), as the driver reports it."""
    bf16_tflops: float
    """Peak dense bf16 tensor-core throughput, TFLOP/s (no structured sparsity)."""
    hbm_tb_s: float
    """Memory bandwidth, TB/s (1e12 bytes/s)."""
    nvlink_gb_s: float
    """NVLink bandwidth per GPU (both directions together), GB/s."""
    internode_gb_s: float
    """Network bandwidth per GPU between nodes (one InfiniBand NIC per GPU), GB/s in one direction."""
    source: str
    """Where the figures come from."""


GPU_PRESETS: dict[str, GPUPreset] = {
    "A100": GPUPreset(
        name="A100-SXM4-80GB",
        memory_gib=80.0,  # 81920 MiB in nvidia-smi
        bf16_tflops=312.0,
        hbm_tb_s=2.039,
        nvlink_gb_s=600.0,
        internode_gb_s=25.0,  # 200 Gb/s HDR per GPU
        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: 312 TFLOPS bf16 dense, 2,039 GB/s, NVLink 600 GB/s); "
        "DGX A100 user guide (8x 200 Gb/s HDR InfiniBand, one per GPU)",
    ),
    "H100": GPUPreset(
        name="H100-SXM5-80GB",
        memory_gib=79.6,  # 81559 MiB in nvidia-smi
        bf16_tflops=989.0,
        hbm_tb_s=3.35,
        nvlink_gb_s=900.0,
        internode_gb_s=50.0,  # 400 Gb/s NDR per GPU
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM: 989 TFLOPS bf16 dense (1,979 with sparsity), 3.35 TB/s, "
        "NVLink 900 GB/s); DGX H100 user guide (8x 400 Gb/s ConnectX-7 NDR, one per GPU)",
    ),
    "H200": GPUPreset(
        name="H200-SXM-141GB",
        memory_gib=140.4,  # 143771 MiB in nvidia-smi
        bf16_tflops=989.0,
        hbm_tb_s=4.8,
        nvlink_gb_s=900.0,
        internode_gb_s=50.0,  # 400 Gb/s NDR per GPU
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB, 4.8 TB/s, 989 TFLOPS bf16 dense, NVLink 900 GB/s); "
        "DGX H200 user guide (8x 400 Gb/s ConnectX-7, one per GPU)",
    ),
}


def gpu_preset(name: str) -> GPUPreset:
    """The preset called ``name`` (case-insensitive: A100, H100, H200), or ValueError listing them."""
    key = name.upper()
    if key not in GPU_PRESETS:
        raise ValueError(f"unknown GPU preset {name!r}; use one of {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[key]
