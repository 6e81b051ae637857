"""What the commands share (feedback/cli/common.py): the one model loader with its flags, and the
perplexity flags whose left-out numbers keep PPLConfig's defaults."""

from __future__ import annotations

import json

from feedback.cli import build_parser, common
from tests.cli.helpers import in_process


def test_unknown_hub_model_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the loader reads it on each load, not only at import
    out = in_process("generate", "--prompt", "hi", "--model", "nobody/no-such-model")
    assert out.returncode == 2 and "could not load model 'nobody/no-such-model'" in out.stderr
    assert "Traceback" not in out.stderr


def test_device_map_with_a_memory_cap_loads_through_the_same_loader():
    out = in_process(
        "generate",
        "--prompt",
        "Hi",
        "--max-new-tokens",
        "4",
        "--device-map",
        "auto",
        "--max-memory",
        "cpu=2GiB",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["rows"][0]["token_ids"]) == 4


def test_ppl_flags_left_out_keep_the_defaults_declared_beside_the_config():
    from feedback.eval.perplexity import PPLConfig

    parse = build_parser().parse_args
    assert common.ppl_config(parse(["ppl"])) == PPLConfig()
    assert common.ppl_config(parse(["ppl", "--bootstrap", "7", "--max-tokens", "9"])) == PPLConfig(
        bootstrap=7, max_tokens_per_doc=9
    )
