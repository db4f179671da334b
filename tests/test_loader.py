"""GGUF loading: every supported tensor type, the writer round trip, and one clear error per defect."""

from __future__ import annotations

import functools
import re
import struct
from datetime import timedelta

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from conftest import DATA, allocation_peak, fixture
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants

from jaxmodel import Model, ModelFormatError, load_model
from jaxmodel.gguf_io import read_gguf, write_gguf
from jaxmodel.kernels import cpu_matmul
from jaxmodel.random_model import PRESETS, random_weights
from jaxmodel.weights import BlockRows
from jaxmodel.tokenizer import load_tokenizer

TINY = DATA / "tiny-qwen35-mtp.gguf"


def rewrite(src, dst, *, arch=None, drop=(), tensors=None, add=None, values=None):
    """Copy a GGUF, optionally renaming the architecture, dropping tensors, replacing tensors with
    (array, qtype) pairs (qtype None for plain numpy arrays), adding plain tensors, or replacing metadata values
    (of the same type)."""
    reader = GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    new_arch = arch or old_arch
    writer = GGUFWriter(str(dst), new_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        value = (values or {}).get(key, field.contents())
        writer.add_key_value(key.replace(old_arch + ".", new_arch + ".", 1), value, field.types[0], sub)
    tensors = tensors or {}
    for t in reader.tensors:
        if t.name in drop:
            continue
        if t.name in tensors:
            array, qtype = tensors[t.name]
            if qtype is None:
                writer.add_tensor(t.name, array)
            else:
                writer.add_tensor(t.name, array, raw_dtype=qtype)  # array holds the blocks' bytes
        else:
            writer.add_tensor(t.name, np.asarray(t.data))
    for name, array in (add or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_unsupported_architecture_is_named(tmp_path):
    path = rewrite(TINY, tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(ModelFormatError, match=r"llama\.gguf: unsupported architecture 'llama'"):
        load_model(path)


def test_missing_tensor_is_named(tmp_path):
    path = rewrite(TINY, tmp_path / "missing.gguf", drop={"blk.1.ssm_a"})
    with pytest.raises(ModelFormatError, match=r"missing\.gguf: missing tensor 'blk\.1\.ssm_a' \(expected shape \(4,\)\)"):
        load_model(path)


def test_misshaped_tensor_is_named(tmp_path):
    path = rewrite(TINY, tmp_path / "shape.gguf", tensors={"blk.0.ssm_norm.weight": (np.ones(8, np.float32), None)})
    with pytest.raises(ModelFormatError, match=r"tensor 'blk\.0\.ssm_norm\.weight' has shape \(8,\), expected \(16,\)"):
        load_model(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    raw = np.zeros((128, 64 // 32 * 17), np.uint8)  # MXFP4: 32 values in 17 bytes
    path = rewrite(TINY, tmp_path / "mxfp4.gguf", tensors={"blk.0.ffn_up.weight": (raw, QT.MXFP4)})
    with pytest.raises(ModelFormatError, match=r"tensor 'blk\.0\.ffn_up\.weight' has unsupported type MXFP4"):
        load_model(path)


def test_truncated_file_is_named(tmp_path):
    data = TINY.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFormatError, match=r"cut\.gguf: truncated: tensor '.*' needs bytes up to"):
        load_model(path)


def test_truncated_k_quant_file_is_named(tmp_path):
    # A llama-quantize Q4_K_M file cut inside its last block tensor: refused before any block is read past the end.
    data = (DATA / "bundled-target-q4_k_m.gguf").read_bytes()
    last = max(GGUFReader(DATA / "bundled-target-q4_k_m.gguf").tensors, key=lambda t: int(t.data_offset))
    path = tmp_path / "cut-q4_k_m.gguf"
    path.write_bytes(data[: int(last.data_offset) + int(last.n_bytes) // 2])
    with pytest.raises(ModelFormatError, match=rf"cut-q4_k_m\.gguf: truncated: tensor '{re.escape(last.name)}'"):
        load_model(path)


def test_not_a_gguf_and_no_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFormatError, match=r"junk\.gguf: not a readable GGUF file"):
        load_model(path)
    with pytest.raises(ModelFormatError, match=r"nothing\.gguf: no such file"):
        load_model(tmp_path / "nothing.gguf")


def test_the_server_refuses_a_corrupt_file_in_one_line(tmp_path):
    """`gdnspec serve` on a truncated GGUF exits at once with one line naming the file and what is wrong."""
    from api.cli import main

    data = TINY.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:2000])
    with pytest.raises(SystemExit, match=r"^gdnspec: cannot load the model: .*cut\.gguf: .*needs \d+ bytes at "
                                         r"offset \d+, the file has \d+ left$"):
        main(["serve", "--model", str(path), "--port", "0"])


def test_the_kv_dtype_option_reaches_the_engine():
    """`gdnspec serve --kv-dtype float16` builds an engine whose KV pages are float16; another dtype is refused."""
    import jax.numpy as jnp

    from api.cli import _build_engine, build_parser

    args = build_parser().parse_args(["serve", "--model", str(TINY), "--kv-dtype", "float16", "--budget-mb", "4"])
    engine, _ = _build_engine(args)
    assert engine.runtime.state.k_pages[0].dtype == jnp.float16
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-dtype", "int8"])


def test_the_replicas_option_shares_the_budget_and_the_rows():
    """`gdnspec serve --replicas 2` serves with two engines, each with half of --max-seqs and --budget-mb; 0 is
    refused before any file is read, and a budget whose half cannot hold one sequence is refused in one line."""
    from api.cli import _build_engine, build_parser
    from scheduler import Replicas

    args = build_parser().parse_args(["serve", "--model", str(TINY), "--budget-mb", "16", "--max-seqs", "8",
                                      "--replicas", "2"])  # fmt: skip
    replicas, _ = _build_engine(args)
    assert isinstance(replicas, Replicas) and len(replicas.engines) == 2
    assert [engine.max_running for engine in replicas.engines] == [4, 4] and replicas.max_running == 8
    assert replicas.engines[0].runtime.shapes.row_buckets == (1, 4)
    args = build_parser().parse_args(["serve", "--model", "/nonexistent.gguf", "--replicas", "0"])
    with pytest.raises(SystemExit, match="--replicas 0"):
        _build_engine(args)
    args = build_parser().parse_args(["serve", "--model", str(TINY), "--budget-mb", "4", "--replicas", "2"])
    with pytest.raises(SystemExit, match="cannot serve with these settings: .* cannot hold one sequence of 2048"):
        _build_engine(args)  # 2 MB an engine


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_writer_round_trip(tmp_path, dtype):
    """Export the fixture's weights and load them back: every matmul weight comes back as its rounding to
    `dtype`, every other tensor exactly; f32 reproduces llama.cpp's logits."""
    cfg, weights, _ = read_gguf(TINY)
    path = tmp_path / f"tiny-{dtype}.gguf"
    write_gguf(path, cfg, weights, dtype=dtype)
    loaded_cfg, loaded, _ = read_gguf(path)
    assert loaded_cfg == cfg
    qtype = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}[dtype]
    convs = {id(layer.mixer.conv) for i, layer in enumerate(weights.layers) if cfg.recurrent[i]}
    matmul = {id(w) for w in jax.tree_util.tree_leaves(weights) if w.ndim == 2 and w is not weights.embed}
    for original, back in zip(jax.tree_util.tree_leaves(weights), jax.tree_util.tree_leaves(loaded)):
        if original.ndim < 2 or id(original) in convs or dtype == "f32":
            expected = original
        elif id(original) in matmul:  # stored transposed: quantisation blocks run along n_in
            expected = quants.dequantize(quants.quantize(original.T, qtype), qtype).T
        else:
            expected = quants.dequantize(quants.quantize(original, qtype), qtype)
        np.testing.assert_array_equal(back, expected)
    if dtype == "f32":
        ref = fixture("tiny-qwen35-mtp")
        logits, _ = load_model(path).score(ref["tokens"])
        np.testing.assert_allclose(logits, ref["A"], atol=1e-3, rtol=0)


def _random_kquant_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Random k-quant bytes whose f16 scales are set to small finite values."""
    block_values, block_bytes = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == QT.Q6_K:  # ql[128] qh[64] scales[16] d
        raw[..., -2:] = scale
    else:  # d, dmin first
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_K, QT.Q5_K, QT.Q6_K])
def test_quantized_types_load_as_their_dequantized_values(tmp_path, qtype):
    """A k-quant (or Q4_0) tensor loads as gguf's dequantisation of its bytes, and the model built from the
    quantised file gives the logits of an F32 file holding those dequantised values: the same bits with XLA's
    products, and within the activations' 8-bit rounding through the CPU block product (which keeps the bytes)."""
    cfg = PRESETS["tiny"].replace(n_embd=256, n_ff=256, n_layer=2, recurrent=(True, False), n_mtp=0)
    weights = random_weights(cfg, seed=1)
    f32_path = tmp_path / "base.gguf"
    write_gguf(f32_path, cfg, weights)
    rng = np.random.default_rng(0)
    cols, rows = weights.layers[0].ffn.up.shape  # stored [F, E] with E a multiple of 256
    raw = _random_kquant_blocks(rng, rows, cols, qtype) if qtype != QT.Q4_0 else quants.quantize(
        weights.layers[0].ffn.up.T, QT.Q4_0)
    quant_path = rewrite(f32_path, tmp_path / "quant.gguf", tensors={"blk.0.ffn_up.weight": (raw, qtype)})
    expected = quants.dequantize(raw, qtype)
    assert expected.shape == (rows, cols) and np.isfinite(expected).all()
    _, loaded, _ = read_gguf(quant_path)
    np.testing.assert_array_equal(loaded.layers[0].ffn.up, expected.T)
    dequant_path = rewrite(f32_path, tmp_path / "dequant.gguf", tensors={"blk.0.ffn_up.weight": (expected, None)})
    tokens = [3, 17, 200, 5, 9]
    a, _ = load_model(quant_path, cpu_kernel=False).score(tokens)
    b, _ = load_model(dequant_path, cpu_kernel=False).score(tokens)
    np.testing.assert_array_equal(a, b)
    kept = load_model(quant_path)
    if cpu_matmul.block_kernels():  # the bytes themselves; Q4_0 and Q4_K in the row groups their products read
        up = kept.weights.layers[0].ffn.up
        assert isinstance(up, BlockRows) and up.row_group == cpu_matmul.row_groups().get(int(qtype), 1)
        np.testing.assert_array_equal(np.asarray(up.file_order().blocks), raw)
    blocks, _ = kept.score(tokens)
    np.testing.assert_allclose(blocks, b, rtol=0, atol=0.05 * np.abs(b).max())


def test_qwen3next_projections_keep_their_blocks(tmp_path):
    """qwen3next's GDN projections group value heads by key head; the loader reorders their output rows into
    tiled order, which a block weight does by moving whole rows, and leaves ssm_out's inputs in the file's order
    (the GDN output's heads are reordered instead): all stay blocks, and the model gives the logits of the same
    file with every weight dequantized (within the activations' 8-bit rounding)."""
    # Three value heads per key head: the grouped-to-tiled permutation is not its own inverse.
    cfg = PRESETS["qwen3next-tiny"].replace(ssm_heads=6)
    src = tmp_path / "f32.gguf"
    write_gguf(src, cfg, random_weights(cfg, seed=2))
    reader = GGUFReader(src)
    names = ("blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_ba.weight", "blk.0.ssm_out.weight")
    data = {t.name: np.asarray(t.data, np.float32) for t in reader.tensors if t.name in names}
    path = rewrite(src, tmp_path / "q4_0.gguf", tensors={n: (quants.quantize(a, QT.Q4_0), QT.Q4_0)
                                                          for n, a in data.items()})  # fmt: skip
    kept, plain = load_model(path), load_model(path, cpu_kernel=False)
    if cpu_matmul.block_kernels():  # the fused projections: the file's blocks, the same weights once dequantized
        blocks, dense = kept.weights.layers[0].mixer.qkv.w, plain.weights.layers[0].mixer.qkv.w
        assert isinstance(blocks, BlockRows)
        np.testing.assert_array_equal(np.asarray(blocks.dequantized()), np.asarray(dense))
        mixer = kept.weights.layers[0].mixer
        assert isinstance(mixer.out, BlockRows) and sorted(mixer.out_heads) == list(range(6))
        assert plain.weights.layers[0].mixer.out_heads is None
    tokens = [3, 17, 200, 5, 9, 44]
    logits, _ = kept.score(tokens)
    want, _ = plain.score(tokens)
    # Rows of 64 inputs: two 8-bit blocks of x per product, so the activations' rounding shows more than at 256.
    np.testing.assert_allclose(logits, want, rtol=0, atol=0.15 * np.abs(want).max())


def test_model_from_random_preset_runs(tmp_path):
    cfg = PRESETS["tiny"]
    model = Model(cfg, random_weights(cfg, seed=3))
    logits, hidden = model.score([1, 2, 3])
    assert logits.shape == (3, cfg.n_vocab) and hidden.shape == (3, cfg.n_embd)
    assert np.isfinite(logits).all()


def test_fused_attention_qkv_and_tied_output_load_as_their_parts(tmp_path):
    """attn_qkv = [Q_full | K | V] along the output rows, and a missing output.weight means the embedding."""
    reader = GGUFReader(TINY)
    tensor = {t.name: np.asarray(t.data) for t in reader.tensors}
    fused = np.concatenate([tensor["blk.3.attn_q.weight"], tensor["blk.3.attn_k.weight"],
                            tensor["blk.3.attn_v.weight"]])  # fmt: skip
    qkv = {"blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.3.attn_v.weight"}
    path = rewrite(TINY, tmp_path / "fused.gguf", drop=qkv | {"output.weight"}, add={"blk.3.attn_qkv.weight": fused})
    _, loaded, _ = read_gguf(path)
    _, original, _ = read_gguf(TINY)
    attn, ref = loaded.layers[3].mixer, original.layers[3].mixer
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(getattr(attn, name), getattr(ref, name))
    np.testing.assert_array_equal(loaded.output, original.embed.T)


def test_random_model_files_carry_the_tokenizer_keys_llama_cpp_requires(tmp_path):
    """llama.cpp refuses a BPE vocabulary without `tokenizer.ggml.merges`; `make-random` files have one merge,
    which the pre-tokenizer never lets apply, so our tokenizer's output is unchanged."""
    import gguf

    from jaxmodel.gguf_io import write_gguf
    from jaxmodel.random_model import PRESETS, random_weights
    from jaxmodel.tokenizer import load_tokenizer

    cfg = PRESETS["tiny"]
    path = tmp_path / "random.gguf"
    write_gguf(path, cfg, random_weights(cfg), dtype="f32", name="random-tiny")
    fields = gguf.GGUFReader(path).fields
    merges = fields["tokenizer.ggml.merges"]
    assert [bytes(merges.parts[i]).decode() for i in merges.data] == ["0 0"]
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == cfg.n_vocab
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    tokenizer = load_tokenizer(path)
    assert tokenizer.decode(tokenizer.encode("x = 100")) == "x = 100"
    assert len(tokenizer.encode("00")) == 2


# ---- hostile files: refused quickly, without allocating what they claim ----------------------------------------


def gguf_header(*fields: bytes, n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(fields)) + b"".join(fields)


def gguf_tensors(entry: bytes) -> bytes:
    """A header with no metadata and one tensor entry (`entry` follows the name's length, 1)."""
    return b"GGUF" + struct.pack("<IQQQ", 3, 1, 0, 1) + entry


def kv(key: bytes, kind: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key + struct.pack("<I", kind) + payload


# Counts and lengths within the limits of tests/test_gguf_limits.py, past the end of the file.
@pytest.mark.parametrize("name, data, message", [
    ("array-past-end", gguf_header(kv(b"a", 9, struct.pack("<IQ", 8, 2**20))),
     r"metadata 'a' \(1048576 items\) needs 8388608 bytes"),
    ("u8-array-past-end", gguf_header(kv(b"a", 9, struct.pack("<IQ", 0, 2**20))), r"metadata 'a' \(\d+ items\)"),
    ("string-past-end", gguf_header(kv(b"general.name", 8, struct.pack("<Q", 2**16))), r"metadata 'general\.name'"),
    ("key-past-end", gguf_header(struct.pack("<Q", 200) + b"\0" * 16), r"the name of metadata key 0 needs"),
    ("many-keys", b"GGUF" + struct.pack("<IQQ", 3, 0, 4096), r"\d+ metadata keys needs"),
    ("many-tensors", b"GGUF" + struct.pack("<IQQ", 3, 2**16, 0), r"\d+ tensor entries needs"),
    ("nested-arrays", gguf_header(kv(b"a", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, 1) * 8)),
     r"nests arrays deeper than"),
    ("unknown-value-type", gguf_header(kv(b"a", 77, b"\0" * 16)), r"unknown value type 77"),
    ("bad-alignment", gguf_header(kv(b"general.alignment", 4, struct.pack("<I", 3))), r"not a power of two"),
    ("tensor-past-end", gguf_tensors(b"t" + struct.pack("<IQQIQ", 2, 2**20, 2**20, 0, 0)),
     r"truncated: tensor 't' needs bytes up to"),
    ("five-dims", gguf_tensors(b"t" + struct.pack("<I", 5) + b"\0" * 52), r"tensor 't' has 5 dimensions"),
    ("short", b"GGUF\3\0\0\0", r"not a readable GGUF file"),
])  # fmt: skip
def test_hostile_headers_are_refused_before_allocating(tmp_path, name, data, message):
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data)
    with allocation_peak() as allocated, pytest.raises(ModelFormatError, match=re.escape(str(path)) + ": .*" + message):
        read_gguf(path)
    assert allocated.peak < 1 << 20, allocated.peak
    with pytest.raises(ModelFormatError):
        load_tokenizer(path)


@pytest.mark.parametrize("key, value, message", [
    ("qwen35.attention.head_count", 0, r"'qwen35\.attention\.head_count' is 0; it must be at least 1"),
    ("qwen35.attention.head_count_kv", 0, r"'qwen35\.attention\.head_count_kv' is 0"),
    ("qwen35.ssm.group_count", 0, r"'qwen35\.ssm\.group_count' is 0"),
    ("qwen35.block_count", 1, r"'qwen35\.block_count' 1 leaves no layer"),
])
def test_zero_counts_are_named(tmp_path, key, value, message):
    path = rewrite(TINY, tmp_path / "zero.gguf", values={key: value})
    with pytest.raises(ModelFormatError, match=r"zero\.gguf: " + message):
        read_gguf(path)


SMALL = DATA / "tiny-qwen35-f16.gguf"


@functools.cache
def small_layout() -> tuple[bytes, int]:
    return SMALL.read_bytes(), GGUFReader(SMALL).data_offset


@st.composite
def mutations(draw):
    data, header_end = small_layout()
    edits = []
    for _ in range(draw(st.integers(1, 6))):
        offset = draw(st.one_of(st.integers(0, header_end + 64), st.integers(0, len(data) - 1)))
        if draw(st.booleans()):
            edits.append((offset, bytes([draw(st.integers(0, 255))])))
        else:  # a length, count or offset field set to an extreme
            value = draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, len(data), header_end]))
            edits.append((offset, struct.pack("<Q", value)))
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    return edits, cut


@settings(max_examples=100, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)  # fmt: skip
@given(mutation=mutations())
def test_mutated_files_load_or_raise_model_format_error(tmp_path_factory, mutation):
    """Bytes of a real GGUF changed (header fields, lengths set to extremes, data, truncation): the loader and
    tokenizer either load it or raise ModelFormatError, quickly and within a small memory bound."""
    data, _ = small_layout()
    edits, cut = mutation
    mutated = bytearray(data)
    for offset, patch in edits:
        mutated[offset:offset + len(patch)] = patch[: len(mutated) - offset]
    path = tmp_path_factory.mktemp("fuzz") / "mutated.gguf"
    path.write_bytes(bytes(mutated[:cut]))
    with allocation_peak() as allocated:
        try:
            cfg, weights, _ = read_gguf(path)
            assert weights.embed.shape == (cfg.n_vocab, cfg.n_embd)
            load_tokenizer(path)
        except ModelFormatError:
            pass
    assert allocated.peak < 64 << 20, allocated.peak
