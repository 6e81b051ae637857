"""llama.cpp beside the engine (feedback/peers.py): the GGUFs it is given, and the run when installed."""

from __future__ import annotations

import numpy as np
import pytest

from feedback import peers


def _tiny_gguf(path):
    """A small GGUF laid out as the embedded one: llama metadata, a Q4_1 weight, an F32 norm."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_token_list(["<a>", "b", "c"])
    writer.add_chat_template("{{ messages }}")
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor(
        "blk.0.ffn_up.weight",
        gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1),
        raw_dtype=gguf.GGMLQuantizationType.Q4_1,
    )
    writer.add_tensor("blk.0.ffn_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_written_ggufs_keep_the_metadata_and_the_weights(tmp_path, kind):
    import gguf

    source, target = tmp_path / "m.Q4_1.gguf", tmp_path / f"m.{kind}.gguf"
    _tiny_gguf(source)
    peers.write_gguf(source, target, kind)
    before, after = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(target))
    for key in (
        "general.architecture",
        "llama.block_count",
        "tokenizer.ggml.tokens",
        "tokenizer.chat_template",
    ):
        assert after.fields[key].contents() == before.fields[key].contents()
    types = {t.name: t.tensor_type.name for t in after.tensors}
    assert types == {"blk.0.ffn_up.weight": kind, "blk.0.ffn_norm.weight": "F32"}
    for old, new in zip(before.tensors, after.tensors, strict=True):
        want = gguf.quants.dequantize(old.data, old.tensor_type)
        got = gguf.quants.dequantize(new.data, new.tensor_type)
        assert got.shape == want.shape
        # F32 holds the Q4_1 values exactly; Q8_0 re-rounds them to 8 bits a block
        tolerance = 0 if kind == "F32" or new.tensor_type.name == "F32" else 0.01 * np.abs(want).max()
        assert np.abs(got - want).max() <= tolerance
    assert peers.gguf_step_bytes(target) == sum(int(t.n_bytes) for t in after.tensors)


def test_without_llama_cpp_the_bench_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    from feedback.cli import main

    monkeypatch.setenv(peers.PEERS_ENV, str(tmp_path))
    assert peers.find_llama_cpp() is None
    assert main(["bench", "--peers-only"]) == 1
    assert f"npm install --prefix {tmp_path} node-llama-cpp@" in capsys.readouterr().err


@pytest.mark.skipif(peers.find_llama_cpp() is None, reason="llama.cpp (npm node-llama-cpp) is not installed")
def test_llama_cpp_decodes_the_shipped_gguf_greedily_from_the_engines_prompt_ids(embedded_lm):
    from feedback.core import embedded

    ids = embedded_lm.encode("What is the capital of France?")
    steps, replies, _ = peers.llama_cpp_runs(
        peers.find_llama_cpp(), embedded.find_gguf(), ids, 8, 1, rounds=2
    )
    assert len(steps) == 2 and all(0 < s < 1 for s in steps)
    assert replies[0] == replies[1] and len(replies[0]) == 8  # greedy: the same tokens each round
    assert all(0 <= t < embedded_lm.vocab_size for t in replies[0])
    assert embedded_lm.tokenizer.decode(replies[0]).strip()  # words, from the same vocabulary
