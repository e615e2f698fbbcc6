"""Write the documented device profiles of this folder from published figures (see README.md).

These devices cannot be timed here, so each profile's latency fit comes from
documented throughput instead of a measurement:

    b [ms per million MACs] = 2e6 FLOP / (peak FP32 FLOP/s × utilisation) × 1e3
    a [ms]                  = assumed per-inference overhead

and its budget from ``derive_budget`` against the shipped fmnist-small cache.
Run ``python profiles/documented.py`` after changing a figure or the cache;
tests/test_profiles.py checks that the files agree with their own fields.
"""

from __future__ import annotations

from pathlib import Path

from feast_edge.budget.profile import DeviceProfile, derive_budget, save_profile
from feast_edge.cache.variants import load_cache
from feast_edge.space.preset import load_preset

PRESET = "fmnist-small"
GiB = 2**30
MEMORY_FRACTION = 0.5  # the feast-agent profile default: half the device's memory for training
CPU_UTILISATION = 0.10  # README "Utilisation": anchored by the measured dev-2core-x86 profile
GPU_UTILISATION = 0.02  # large GPUs at batch 1 on 28x28 inputs: a few % of peak
SMALL_GPU_UTILISATION = 0.05  # 128-core Maxwell: fewer cores to fill, a larger share

# (name, device, description, hardware, assumed overhead a in ms, latency target in ms, memory the limit is a fraction of, sources)
DEVICES = [
    (
        "jetson-nano",
        "cuda",
        "NVIDIA Jetson Nano 4GB developer kit (Maxwell GPU), documented figures",
        {
            "cpu": "4x Arm Cortex-A57 @ 1.43 GHz",
            "cores": 4,
            "machine": "aarch64",
            "ram_bytes": 4 * GiB,
            "cuda_name": "NVIDIA Tegra X1 Maxwell GPU, 128 CUDA cores @ 921.6 MHz",
            "cuda_memory_bytes": 4 * GiB,
            "memory": "4 GB 64-bit LPDDR4, shared by CPU and GPU",
            "peak_fp32_gflops": 235.9,
            "peak_derivation": "128 cores x 2 FLOP per FMA x 0.9216 GHz; NVIDIA quotes 472 GFLOPS FP16, which this GPU runs at 2x the FP32 rate",
            "assumed_utilisation": SMALL_GPU_UTILISATION,
            "assumed_overhead_ms": 4.0,
            "memory_fraction": MEMORY_FRACTION,
        },
        4.5,
        "NVIDIA Jetson Nano Developer Kit specifications (128-core Maxwell GPU, 472 GFLOPS FP16, quad-core Cortex-A57 @ 1.43 GHz, 4 GB LPDDR4)",
    ),
    (
        "raspberry-pi-5",
        "cpu",
        "Raspberry Pi 5 8GB (4x Cortex-A76 @ 2.4 GHz, CPU inference), documented figures",
        {
            "cpu": "Broadcom BCM2712, 4x Arm Cortex-A76 @ 2.4 GHz",
            "cores": 4,
            "machine": "aarch64",
            "ram_bytes": 8 * GiB,
            "memory": "8 GB LPDDR4X-4267",
            "peak_fp32_gflops": 153.6,
            "peak_derivation": "4 cores x 2.4 GHz x 16 FP32 FLOP/cycle (two 128-bit NEON FMA pipes per Cortex-A76 core)",
            "assumed_utilisation": CPU_UTILISATION,
            "assumed_overhead_ms": 2.0,
            "memory_fraction": MEMORY_FRACTION,
        },
        3.0,
        "Raspberry Pi 5 product brief (BCM2712, quad-core Cortex-A76 @ 2.4 GHz, 4/8 GB LPDDR4X); Arm Cortex-A76 Software Optimization Guide (2 ASIMD/FP pipes with FMA)",
    ),
    (
        "jetson-orin-nano",
        "cuda",
        "NVIDIA Jetson Orin Nano 8GB module (Ampere GPU, original 15 W clocks), documented figures",
        {
            "cpu": "6x Arm Cortex-A78AE @ 1.5 GHz",
            "cores": 6,
            "machine": "aarch64",
            "ram_bytes": 8 * GiB,
            "cuda_name": "NVIDIA Ampere GPU, 1024 CUDA cores + 32 Tensor Cores @ 625 MHz",
            "cuda_memory_bytes": 8 * GiB,
            "memory": "8 GB 128-bit LPDDR5, shared by CPU and GPU",
            "peak_fp32_gflops": 1280.0,
            "peak_derivation": "1024 CUDA cores x 2 FLOP per FMA x 0.625 GHz (the 40 TOPS figure is sparse INT8 on Tensor Cores, not used by FP32 PyTorch)",
            "assumed_utilisation": GPU_UTILISATION,
            "assumed_overhead_ms": 2.5,
            "memory_fraction": MEMORY_FRACTION,
        },
        3.5,
        "NVIDIA Jetson Orin Nano series data sheet (1024-core Ampere GPU @ 625 MHz, 40 TOPS sparse INT8, 6-core Cortex-A78AE @ 1.5 GHz, 8 GB LPDDR5)",
    ),
    (
        "laptop-cpu",
        "cpu",
        "Typical laptop CPU: 4 x86 performance cores with AVX2/FMA, 16 GB RAM, documented figures",
        {
            "cpu": "4 x86-64 performance cores @ ~3.0 GHz all-core, AVX2 + FMA (e.g. Intel Core 11th-13th gen P-cores, AMD Zen 3/4 mobile)",
            "cores": 4,
            "machine": "x86_64",
            "ram_bytes": 16 * GiB,
            "memory": "16 GB DDR4/LPDDR5",
            "peak_fp32_gflops": 384.0,
            "peak_derivation": "4 cores x 3.0 GHz x 32 FP32 FLOP/cycle (two 256-bit FMA units per core)",
            "assumed_utilisation": CPU_UTILISATION,
            "assumed_overhead_ms": 0.8,
            "memory_fraction": MEMORY_FRACTION,
        },
        1.75,
        "Intel and AMD architecture manuals (two 256-bit FMA units per core on Intel Core P-cores since Haswell and on AMD Zen 3/4); a typical 4-core laptop's sustained all-core clock",
    ),
    (
        "jetson-agx-orin",
        "cuda",
        "NVIDIA Jetson AGX Orin 64GB (Ampere GPU, MAXN), documented figures",
        {
            "cpu": "12x Arm Cortex-A78AE @ 2.2 GHz",
            "cores": 12,
            "machine": "aarch64",
            "ram_bytes": 64 * GiB,
            "cuda_name": "NVIDIA Ampere GPU, 2048 CUDA cores + 64 Tensor Cores @ 1.3 GHz",
            "cuda_memory_bytes": 64 * GiB,
            "memory": "64 GB 256-bit LPDDR5, shared by CPU and GPU",
            "peak_fp32_gflops": 5324.8,
            "peak_derivation": "2048 CUDA cores x 2 FLOP per FMA x 1.3 GHz (NVIDIA: 5.3 FP32 TFLOPS; 275 TOPS is sparse INT8 on GPU + DLAs)",
            "assumed_utilisation": GPU_UTILISATION,
            "assumed_overhead_ms": 2.0,
            "memory_fraction": MEMORY_FRACTION,
        },
        2.6,
        "NVIDIA Jetson AGX Orin Series Technical Brief (2048-core Ampere GPU @ 1.3 GHz, 5.3 FP32 TFLOPS, 275 TOPS sparse INT8, 12-core Cortex-A78AE @ 2.2 GHz, 64 GB LPDDR5)",
    ),
    (
        "desktop-gpu",
        "cuda",
        "Desktop with an NVIDIA GeForce RTX 3060 12GB, documented figures",
        {
            "cpu": "x86-64 desktop CPU (host for the GPU)",
            "machine": "x86_64",
            "ram_bytes": 32 * GiB,
            "cuda_name": "NVIDIA GeForce RTX 3060, 3584 CUDA cores @ 1.777 GHz boost",
            "cuda_memory_bytes": 12 * GiB,
            "memory": "12 GB GDDR6 on the GPU (training runs there)",
            "peak_fp32_gflops": 12737.0,
            "peak_derivation": "3584 CUDA cores x 2 FLOP per FMA x 1.777 GHz (NVIDIA: 12.7 FP32 TFLOPS)",
            "assumed_utilisation": GPU_UTILISATION,
            "assumed_overhead_ms": 1.0,
            "memory_fraction": MEMORY_FRACTION,
        },
        1.5,
        "NVIDIA GeForce RTX 3060 specifications (3584 CUDA cores, 1.78 GHz boost, 12 GB GDDR6)",
    ),
]


def slope(peak_fp32_gflops: float, utilisation: float) -> float:
    """``b`` in ms per million MACs: 2e6 FLOP / (peak × utilisation) FLOP/s, in ms."""
    return 2e6 / (peak_fp32_gflops * 1e9 * utilisation) * 1e3


def documented_profiles() -> list[DeviceProfile]:
    """The six documented profiles, budgets derived against the shipped fmnist-small cache."""
    preset = load_preset(PRESET)
    cache = load_cache(preset)
    profiles = []
    for name, device, description, hardware, target, sources in DEVICES:
        a = hardware["assumed_overhead_ms"]
        b = slope(hardware["peak_fp32_gflops"], hardware["assumed_utilisation"])
        memory = hardware["cuda_memory_bytes"] if device == "cuda" else hardware["ram_bytes"]
        limit = int(MEMORY_FRACTION * memory)
        profiles.append(
            DeviceProfile(
                name=name,
                description=description,
                device=device,
                hardware=hardware,
                preset=PRESET,
                latency_a_ms=a,
                latency_b_ms_per_mmac=b,
                latency_target_ms=target,
                memory_limit_bytes=limit,
                budget_macs=derive_budget(cache, preset, a, b, target, limit),
                source=(
                    f"documented, not measured: {sources}. b = 2e6 FLOP / (peak {hardware['peak_fp32_gflops']:g} GFLOPS FP32 "
                    f"x assumed utilisation {hardware['assumed_utilisation']:g}); a = assumed per-inference overhead; "
                    f"memory limit = {MEMORY_FRACTION:g} x {'GPU' if device == 'cuda' else 'system'} memory; "
                    "latency target chosen per device class (profiles/README.md)"
                ),
            )
        )
    return profiles


if __name__ == "__main__":
    here = Path(__file__).parent
    for profile in documented_profiles():
        print(save_profile(profile, here / f"{profile.name}.json"), f"{profile.budget_macs / 1e6:.2f}M MACs")
