"""qwen3next files: the writer reproduces the converter's layout (value heads grouped, ssm_ba fused, no rope
sections), and the legacy fused `ssm_in` projection loads as the same model. Parity with llama.cpp and HF is in
test_model_parity.py."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DATA, fixture
from gguf import GGUFReader
from test_loader import rewrite

from jaxmodel import ModelFormatError, load_model
from jaxmodel.gguf_io import read_gguf, tiled_head_order, write_gguf

NEXT = DATA / "tiny-qwen3next.gguf"


def test_tiled_head_order_pairs_every_value_head_with_its_key_head():
    Hk, Hv = 4, 12
    order = tiled_head_order(Hk, Hv)
    assert sorted(order) == list(range(Hv))
    for tiled, grouped in enumerate(order):
        assert tiled % Hk == grouped // (Hv // Hk)  # the same key head in both layouts


def test_writer_reproduces_the_converters_tensors(tmp_path):
    cfg, weights, _ = read_gguf(NEXT)
    assert cfg.arch == "qwen3next" and cfg.rope_sections is None and cfg.n_expert == 4
    path = tmp_path / "rewritten.gguf"
    write_gguf(path, cfg, weights)
    original = {t.name: np.asarray(t.data) for t in GGUFReader(NEXT).tensors}
    written = {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors}
    assert set(written) == set(original)
    for name, data in original.items():
        np.testing.assert_array_equal(written[name].reshape(data.shape), data, err_msg=name)
    fields = GGUFReader(path).fields
    assert "qwen3next.rope.dimension_sections" not in fields
    assert read_gguf(path)[0] == cfg


def test_legacy_fused_ssm_in_loads_as_the_same_model(tmp_path):
    """ssm_in is per key head [q Dk | k Dk | v r*Dv | z r*Dv]; built here from attn_qkv and attn_gate."""
    cfg, _, reader = read_gguf(NEXT)
    Hk, Hv, Dk, E = cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state, cfg.n_embd
    r = Hv // Hk
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    fused, drop = {}, set()
    for layer in cfg.gdn_layers:
        p = f"blk.{layer}."
        qkv, z = tensors[p + "attn_qkv.weight"], tensors[p + "attn_gate.weight"]  # [C, E], [Hv Dk, E]
        q, k, v = qkv[: Hk * Dk], qkv[Hk * Dk : 2 * Hk * Dk], qkv[2 * Hk * Dk :]
        per_key_head = [
            np.concatenate([q.reshape(Hk, Dk, E)[g], k.reshape(Hk, Dk, E)[g],
                            v.reshape(Hk, r * Dk, E)[g], z.reshape(Hk, r * Dk, E)[g]])
            for g in range(Hk)
        ]  # fmt: skip
        fused[p + "ssm_in.weight"] = np.concatenate(per_key_head)
        drop |= {p + "attn_qkv.weight", p + "attn_gate.weight"}
    path = rewrite(NEXT, tmp_path / "legacy.gguf", drop=drop, add=fused)
    ref = fixture("tiny-qwen3next")
    logits, _ = load_model(path, load_mtp=False).score(ref["tokens"])
    np.testing.assert_allclose(logits, ref["A"], atol=1e-3, rtol=0)


def test_qwen3next_without_experts_is_refused(tmp_path):
    _drop_key(NEXT, tmp_path / "no-experts.gguf", "qwen3next.expert_count")
    with pytest.raises(ModelFormatError, match=r"no-experts\.gguf: qwen3next needs 'qwen3next\.expert_count' > 0"):
        load_model(tmp_path / "no-experts.gguf")


def _drop_key(src, dst, key):
    from gguf import GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", key):
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("preset", ["qwen3next-tiny", "qwen35moe-tiny"])
def test_random_moe_presets_round_trip_through_their_files(tmp_path, preset):
    from jaxmodel import Model
    from jaxmodel.random_model import PRESETS, random_weights

    cfg = PRESETS[preset]
    weights = random_weights(cfg, seed=2)
    path = tmp_path / f"{preset}.gguf"
    write_gguf(path, cfg, weights)
    loaded = load_model(path)
    assert loaded.cfg.replace(norm_eps=cfg.norm_eps) == cfg  # the file stores eps as float32
    tokens = list(range(5, 40, 3))
    np.testing.assert_allclose(loaded.score(tokens)[0], Model(cfg, weights).score(tokens)[0], atol=1e-5, rtol=0)
