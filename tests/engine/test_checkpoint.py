"""TensorIndex: bit-exact zero-copy reads and one clear CheckpointError per kind of damage."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.checkpoint import EXPERT_FIELDS, INDEX_NAME, CheckpointError, TensorIndex


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t` as a flat uint8 tensor (for bit-exact comparison)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _u8(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(dtype)


def _sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (4, 8), dtype=torch.uint8, generator=g)
    return {
        "a.fp8": raw.clone().view(torch.float8_e4m3fn),  # random bytes, NaN codes too
        "a.e8m0": _u8([0, 1, 126, 127, 128, 254, 255, 3], torch.float8_e8m0fnu).reshape(2, 4),
        "a.i8": (raw.to(torch.int16) - 128).to(torch.int8)[:, :6].contiguous(),
        "a.u8": raw[:3].clone(),
        "a.i64": torch.tensor([[0, -1, 2**62 + 5], [-(2**63), 2**63 - 1, 7]], dtype=torch.int64),
        "a.bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "a.f32": torch.randn(7, generator=g),
        "a.i32": torch.tensor([-5, 2**31 - 1], dtype=torch.int32),
        "a.f16": torch.randn(2, 2, generator=g).half(),
        "a.scalar": torch.tensor(3.5),
        "a.empty": torch.zeros(0, 4),
    }


def _write_raw(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    """Hand-write a safetensors file: u64 header length, header bytes, data section."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def _hf_dir(tmp_path: Path) -> Path:
    """An official-style checkpoint: two shards plus model.safetensors.index.json."""
    e = {"w1.weight": (4, 8), "w1.scale": (4, 1), "w3.weight": (4, 8), "w3.scale": (4, 1)}
    e |= {"w2.weight": (8, 4), "w2.scale": (8, 1)}
    shard1 = {"embed.weight": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)}
    shard2 = {"layers.0.ffn.gate.tid2eid": torch.arange(6, dtype=torch.int64).reshape(3, 2)}
    fill = 0
    for prefix, n in (("layers.3", 3), ("mtp.0", 2)):
        for i in range(n):
            for k, shape in e.items():
                fill += 7  # distinct contents per tensor
                dtype = torch.int8 if k.endswith("weight") else torch.float8_e8m0fnu
                v = torch.full(shape, fill, dtype=torch.uint8) + torch.arange(shape[1]).byte()
                shard2[f"{prefix}.ffn.experts.{i}.{k}"] = v.view(dtype)
    save_file(shard1, tmp_path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(shard2, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in shard1}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in shard2}
    total = sum(t.numel() * t.element_size() for t in (*shard1.values(), *shard2.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    return tmp_path


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` (Linux /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            lo, hi = line.split()[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


# ----------------------------------------------------------------------------- reading


def test_single_file_round_trip_is_bit_exact(tmp_path):
    tensors = _sample()
    path = tmp_path / "one.safetensors"
    save_file(tensors, path, metadata={"kind": "sample"})
    with TensorIndex.open(path) as idx:
        assert idx.names() == sorted(tensors)
        assert len(idx) == len(tensors)
        assert idx.files() == [path]
        assert idx.metadata(path) == {"kind": "sample"}
        assert idx.metadata("one.safetensors") == {"kind": "sample"}
        assert idx.total_bytes() == sum(t.numel() * t.element_size() for t in tensors.values())
        for name, want in tensors.items():
            got = idx.get(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(_bits(got), _bits(want)), name
            info = idx.info(name)
            assert info.shape == tuple(want.shape) and info.torch_dtype == want.dtype
            assert info.nbytes == want.numel() * want.element_size()
            assert info.file == path
        assert idx.info("a.e8m0").dtype == "F8_E8M0" and idx.info("a.fp8").dtype == "F8_E4M3"
        assert idx.get("a.e8m0")[0, 3].item() == 1.0  # byte 127 = 2^0
        assert idx.get("a.i64")[1, 0].item() == -(2**63)


def test_views_are_zero_copy_into_one_mapping(tmp_path):
    path = tmp_path / "one.safetensors"
    save_file(_sample(), path)
    with TensorIndex.open(path) as idx:
        a, b = idx.get("a.bf16"), idx.get("a.bf16")
        assert a.data_ptr() == b.data_ptr()  # same bytes, not two copies
        ranges = _mapped_ranges(path)
        assert len(ranges) == 1  # one mapping per file
        lo, hi = ranges[0]
        for name in idx.names():
            t, info = idx.get(name), idx.info(name)
            if info.nbytes:
                assert lo <= t.data_ptr() and t.data_ptr() + info.nbytes <= hi, name
                # the view sits at the tensor's absolute file offset within the mapping
                assert t.data_ptr() - lo == info.offset, name
        with open(path, "rb") as f:  # and `offset` is where the bytes really are
            f.seek(idx.info("a.i64").offset)
            assert f.read(16) == bytes(_bits(idx.get("a.i64"))[:16].tolist())


def test_hf_index_directory_and_get_expert(tmp_path):
    ckpt = _hf_dir(tmp_path)
    index = json.loads((ckpt / INDEX_NAME).read_text())
    for where in (ckpt, ckpt / INDEX_NAME):
        with TensorIndex.open(where) as idx:
            assert idx.names() == sorted(index["weight_map"])
            assert [f.name for f in idx.files()] == [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
            ]
            assert idx.total_bytes() == index["metadata"]["total_size"]
            assert idx.metadata("model-00001-of-00002.safetensors") == {"format": "pt"}
            assert idx.metadata(ckpt / "model-00002-of-00002.safetensors") == {}
            assert "embed.weight" in idx and "nope" not in idx
            assert idx.info("embed.weight").file == ckpt / "model-00001-of-00002.safetensors"
            assert idx.get("layers.0.ffn.gate.tid2eid").tolist() == [[0, 1], [2, 3], [4, 5]]
            assert idx.get("embed.weight").float().sum().item() == 66.0

            expert = idx.get_expert(3, 2)
            assert list(expert) == list(EXPERT_FIELDS)
            for k, t in expert.items():
                want = idx.get(f"layers.3.ffn.experts.2.{k}")
                assert t.data_ptr() == want.data_ptr() and t.dtype == want.dtype
            assert expert["w1.weight"].dtype == torch.int8
            assert expert["w2.scale"].dtype == torch.float8_e8m0fnu
            assert expert["w2.weight"].shape == (8, 4)
            mtp = idx.get_expert(0, 1, prefix="mtp")
            assert torch.equal(mtp["w3.weight"], idx.get("mtp.0.ffn.experts.1.w3.weight"))
            with pytest.raises(CheckpointError, match=r"'layers\.3\.ffn\.experts\.3' lacks w1"):
                idx.get_expert(3, 3)


def test_directory_without_index_reads_every_file(tmp_path):
    save_file({"embed.weight": torch.ones(2, 2)}, tmp_path / "global.safetensors")
    save_file({"layers.0.x": torch.zeros(3, dtype=torch.int64)}, tmp_path / "layer_00.safetensors")
    (tmp_path / "manifest.json").write_text("{}")
    with TensorIndex.open(tmp_path) as idx:
        assert idx.names() == ["embed.weight", "layers.0.x"]
        assert [f.name for f in idx.files()] == ["global.safetensors", "layer_00.safetensors"]
        assert idx.get("layers.0.x").tolist() == [0, 0, 0]


def test_close_keeps_handed_out_views_valid(tmp_path):
    path = tmp_path / "one.safetensors"
    save_file({"x": torch.arange(1000, dtype=torch.int64)}, path)
    idx = TensorIndex.open(path)
    view = idx.get("x")
    idx.close()
    assert view.sum().item() == 499500  # still readable after close
    with pytest.raises(CheckpointError, match="closed"):
        idx.get("x")
    del view
    assert _mapped_ranges(path) == []  # the mapping goes away with its last view


def test_unaligned_offsets_and_f4(tmp_path):
    # U8 [3] then BF16 [2] at data offset 3 (odd, not 2-aligned), then packed fp4 [2, 4].
    header = {
        "b": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "h": {"dtype": "BF16", "shape": [2], "data_offsets": [3, 7]},
        "q": {"dtype": "F4", "shape": [2, 4], "data_offsets": [7, 11]},
    }
    bf16 = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    data = bytes([9, 8, 7]) + bytes(_bits(bf16).tolist()) + bytes([0x21, 0x43, 0x65, 0x87])
    path = _write_raw(tmp_path / "odd.safetensors", header, data)
    with TensorIndex.open(path) as idx:
        assert idx.get("b").tolist() == [9, 8, 7]
        assert idx.get("h").tolist() == [1.5, -2.0]
        assert idx.info("h").offset % 2 == 1
        q = idx.get("q")
        assert q.dtype == torch.float4_e2m1fn_x2 and q.shape == (2, 2)  # 2 fp4 values / byte
        assert idx.info("q").shape == (2, 2) and idx.info("q").nbytes == 4
        assert _bits(q).tolist() == [0x21, 0x43, 0x65, 0x87]
        assert idx.get("h").data_ptr() - idx.get("b").data_ptr() == 3  # still zero-copy


def test_offsets_beyond_4_gib(tmp_path):
    """A sparse 4 GiB+ file: offsets past 2^32 are read correctly without reading the file."""
    big = 2**32 + 8
    header = {
        "big": {"dtype": "U8", "shape": [big], "data_offsets": [0, big]},
        "tail": {"dtype": "I64", "shape": [2], "data_offsets": [big, big + 16]},
    }
    path = _write_raw(tmp_path / "big.safetensors", header)
    with open(path, "r+b") as f:
        f.seek(0, 2)
        f.seek(f.tell() + big)
        f.write(struct.pack("<2q", 123456789012, -5))
    with TensorIndex.open(path) as idx:
        assert idx.get("tail").tolist() == [123456789012, -5]
        assert idx.get("big").shape == (big,)
        assert idx.info("tail").offset > 2**32


# ----------------------------------------------------------------------------- errors


def _expect(path: Path, *patterns: str):
    with pytest.raises(CheckpointError) as err:
        TensorIndex.open(path)
    for p in patterns:
        assert p in str(err.value), (p, str(err.value))
    return str(err.value)


def test_index_problems(tmp_path):
    ckpt = _hf_dir(tmp_path)
    index = ckpt / INDEX_NAME
    good = index.read_text()

    index.write_text("{not json")
    _expect(ckpt, INDEX_NAME, "index is not valid JSON")
    index.write_text('{"metadata": {}}')
    _expect(ckpt, "no 'weight_map'")
    index.write_text('{"weight_map": {}}')
    _expect(ckpt, "'weight_map' lists no tensors")
    _expect(ckpt / "other.index.json", "other.index.json", "index file does not exist")

    index.unlink()
    _expect(ckpt, f"{INDEX_NAME} is missing", "download looks incomplete")

    doc = json.loads(good)
    doc["weight_map"]["head.weight"] = "model-00003-of-00003.safetensors"
    index.write_text(json.dumps(doc))
    _expect(ckpt, "model-00003-of-00003.safetensors", "missing", "download looks incomplete")

    doc = json.loads(good)
    doc["weight_map"]["head.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    _expect(ckpt, "model-00001-of-00002.safetensors", "'head.weight'", "header lacks it")

    doc = json.loads(good)  # both shards still listed, one tensor pointed at the wrong one
    doc["weight_map"]["layers.0.ffn.gate.tid2eid"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    _expect(ckpt, "'layers.0.ffn.gate.tid2eid'", "lacks it (it is in model-00002-of-00002")


def test_missing_paths(tmp_path):
    _expect(tmp_path, "no model.safetensors.index.json and no *.safetensors")
    _expect(tmp_path / "nope.safetensors", "nope.safetensors", "does not exist")


def test_short_file_and_bad_header_length(tmp_path):
    (tmp_path / "e.safetensors").write_bytes(b"")
    _expect(tmp_path / "e.safetensors", "e.safetensors", "file is 0 bytes, shorter than the 8")
    (tmp_path / "s.safetensors").write_bytes(b"\x01\x02\x03")
    _expect(tmp_path / "s.safetensors", "s.safetensors", "file is 3 bytes, shorter than the 8")
    path = _write_raw(tmp_path / "b.safetensors", {}, length=1000)
    _expect(path, "b.safetensors", "header length field says 1000 bytes but only 2 follow")


def test_bad_header_json(tmp_path):
    _expect(_write_raw(tmp_path / "a.safetensors", b"{oops"), "a.safetensors", "not valid JSON")
    _expect(_write_raw(tmp_path / "b.safetensors", b"[1, 2]"), "b.safetensors", "not an object")
    _expect(_write_raw(tmp_path / "c.safetensors", b"\xff\xfe"), "c.safetensors", "not valid JSON")
    dup = b'{"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "x": {}}'
    _expect(_write_raw(tmp_path / "d.safetensors", dup, b"\0"), "'x' appears twice")
    meta = {"__metadata__": {"a": 1}}
    _expect(_write_raw(tmp_path / "e.safetensors", meta), "__metadata__ must be an object")


def test_bad_tensor_entries(tmp_path):
    def entry(dtype="U8", shape=(4,), offsets=(0, 4)):
        return {"t": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}

    p = tmp_path / "x.safetensors"
    _expect(_write_raw(p, entry(dtype="F8_E3M4"), bytes(4)),
            "x.safetensors", "tensor 't' has unknown dtype 'F8_E3M4'")
    _expect(_write_raw(p, entry(dtype="F32"), bytes(4)),
            "tensor 't': shape [4] x F32 needs 16 bytes but data_offsets [0, 4] span 4")
    _expect(_write_raw(p, entry(shape=(-4,)), bytes(4)), "invalid shape [-4]")
    _expect(_write_raw(p, entry(offsets=(4, 0)), bytes(4)), "invalid data_offsets [4, 0]")
    _expect(_write_raw(p, {"t": [1]}, bytes(4)), "entry for tensor 't' is not an object")
    _expect(_write_raw(p, entry(offsets=(2, 6)), bytes(4)),
            "tensor 't' ends at byte", "is truncated")
    _expect(_write_raw(p, entry(dtype="F4", shape=(3,), offsets=(0, 1.5)), bytes(4)),
            "invalid data_offsets")
    _expect(_write_raw(p, entry(dtype="F4", shape=(2, 3), offsets=(0, 3)), bytes(4)),
            "F4 tensor 't' needs an even last dimension, got [2, 3]")


def test_truncated_file_detected_at_open(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(16), "b": torch.ones(16, dtype=torch.int64)}, path)
    path.write_bytes(path.read_bytes()[:-1])
    _expect(path, "t.safetensors", "has only", "is truncated")


def test_overlapping_tensors(tmp_path):
    header = {
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "z": {"dtype": "U8", "shape": [0], "data_offsets": [4, 4]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]},
    }
    path = _write_raw(tmp_path / "o.safetensors", header, bytes(16))
    _expect(path, "o.safetensors", "tensors 'a' and 'b' overlap")


def test_tensor_in_two_files(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(2), "v": torch.ones(1)}, tmp_path / "b.safetensors")
    _expect(tmp_path, "b.safetensors", "tensor 'w' is also in", "a.safetensors")


def test_lookup_errors(tmp_path):
    path = tmp_path / "one.safetensors"
    save_file({"w": torch.ones(2)}, path)
    with TensorIndex.open(path) as idx:
        with pytest.raises(CheckpointError, match="tensor 'v' is not in this checkpoint"):
            idx.get("v")
        with pytest.raises(CheckpointError, match="not a file of this checkpoint"):
            idx.metadata("other.safetensors")
