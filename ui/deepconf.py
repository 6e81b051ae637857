"""DeepConf settings shared by the Compare tab's Calibrate and the Deep Think tab."""
from __future__ import annotations

from feedback.eval.voting import ETA, PRESETS

ETA_CHOICES = ["DeepConf-low (keep 10%)", "DeepConf-high (keep 90%)", "custom"]


def resolve_eta(preset: str, custom) -> float:
    """η, the share of warm-up traces kept, from the preset radio (or the custom box)."""
    if preset.startswith("DeepConf-low"):
        return PRESETS["deepconf-low"]
    if preset.startswith("DeepConf-high"):
        return PRESETS["deepconf-high"]
    return ETA.check(custom)
