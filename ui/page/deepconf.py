"""DeepConf settings shared by the Compare tab's Calibrate and the Deep Think tab."""

from __future__ import annotations

from feedback.eval.voting import ETA, PRESETS
from feedback.serve.gpu_time import GpuWork

ETA_CHOICES = ["DeepConf-low (keep 10%)", "DeepConf-high (keep 90%)", "custom"]


def resolve_eta(preset: str, custom) -> float:
    """η, the share of warm-up traces kept, from the preset radio (or the custom box)."""
    if preset.startswith("DeepConf-low"):
        return PRESETS["deepconf-low"]
    if preset.startswith("DeepConf-high"):
        return PRESETS["deepconf-high"]
    return ETA.check(custom)


def traces_gpu_work(lm, cfg, runs: list[int]) -> GpuWork:
    """The GPU work of DeepConf traces of `cfg`: one batched run of each size in `runs` (traces of
    both sides together), each decoding `cfg.max_new_tokens` steps after the prompt (prefilled per
    side at most)."""
    prompt = len(lm.encode(cfg.prompt, cfg.chat_template))
    new = cfg.max_new_tokens
    return GpuWork(
        steps=len(runs) * new,
        row_tokens=sum(runs) * new,
        scored=len(runs) * 2 * prompt,
        how=" then ".join(f"{n} traces" for n in runs) + f" x {new:,} new tokens",
        fewer="fewer traces or warm-up traces, or fewer max new tokens",
    )
