"""A tensor the diff cannot read is damaged input (exit 2 naming the file and the tensor), never a
row that reads as "diverged"; every dtype safetensors defines is read (float6 bitwise, as float4)."""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from tracedump.cli import main
from tracedump.store.format import MANIFEST, ORDER_KEY, pass_file_name


def _run(run_dir: Path, entries: dict[str, tuple[str, list[int], bytes]]) -> Path:
    """A run dir with one pass whose header is written by hand: ``{name: (code, shape, data)}``."""
    run_dir.mkdir(parents=True)
    manifest = {"rank": 0, "pid": 1, "root": "Toy", "settings": {"mode": "full", "token_dim": 0}}
    (run_dir / MANIFEST).write_text(json.dumps(manifest))
    header: dict[str, Any] = {
        "__metadata__": {"tracedump.mode": "full", ORDER_KEY: json.dumps(list(entries))}
    }
    data, offset = b"", 0
    for name, (code, shape, raw) in entries.items():
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    text = json.dumps(header).encode()
    path = run_dir / pass_file_name(0)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _diff(a: Path, b: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["diff", str(a), str(b), "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


F32 = ("F32", [2, 4], struct.pack("<8f", *range(8)))


@pytest.mark.parametrize("code", ["F6_E2M3", "F6_E3M2"])
def test_float6_is_compared_bitwise_equal_and_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], code: str
) -> None:
    packed = bytes(range(12))  # 16 values of 6 bits: 12 bytes
    a = _run(tmp_path / "a", {"x": F32, "q": (code, [2, 8], packed)}).parent
    b = _run(tmp_path / "b", {"x": F32, "q": (code, [2, 8], packed)}).parent
    c = _run(tmp_path / "c", {"x": F32, "q": (code, [2, 8], packed[:-1] + b"\x7f")}).parent

    assert _diff(a, b, capsys)[0] == 0
    assert _diff(a, a, capsys)[0] == 0
    code_c, out, err = _diff(c, a, capsys)
    assert code_c == 1 and "first divergence: pass 0 q" in out, (out, err)


def test_float6_that_does_not_fill_whole_bytes_is_a_bad_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _run(tmp_path / "a", {"x": F32, "q": ("F6_E2M3", [3], b"\0\0\0")}).parent

    code, _, err = _diff(a, a, capsys)

    assert code == 2 and "whole bytes" in err and "pass00000" in err, err


def test_an_unknown_dtype_is_exit_2_naming_the_file_and_the_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _run(tmp_path / "a", {"x": F32, "odd": ("X9", [4], b"\0" * 4)})

    code, _, err = _diff(path.parent, path.parent, capsys)

    assert code == 2, err
    assert str(path) in err and "'odd'" in err and "x9" in err and len(err.strip().splitlines()) == 1, err


def test_a_pass_truncated_after_its_header_was_read_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The premise built, not raced: the file is cut between the header read and the data read."""
    path = _run(tmp_path / "a", {"x": F32, "y": F32})
    b = _run(tmp_path / "b", {"x": F32, "y": F32}).parent
    real_map = mmap.mmap

    def map_after_a_cut(fileno: int, length: int, *args: Any, **kwargs: Any) -> mmap.mmap:
        """The data's map, made after every header was read: the file is cut first."""
        if os.fstat(fileno).st_ino == path.stat().st_ino and path.stat().st_size == size:
            os.truncate(path, size - 20)
        return real_map(fileno, length, *args, **kwargs)

    size = path.stat().st_size
    monkeypatch.setattr(mmap, "mmap", map_after_a_cut)

    code, out, err = _diff(path.parent, b, capsys)

    assert code == 2, (out, err)
    assert str(path) in err and "truncated while being read" in err, err


def test_a_pass_truncated_after_it_was_mapped_is_exit_2_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is cut after the map was made and before the second tensor's view is taken: its
    pages past the new end would be a SIGBUS, so the file's size is asked again per tensor."""
    from tracedump.compare.load import reader

    path = _run(tmp_path / "a", {"x": F32, "y": F32})
    b = _run(tmp_path / "b", {"x": F32, "y": F32}).parent
    real_array = reader.SafetensorsMap.array

    def cut_before_y(self: reader.SafetensorsMap, name: str) -> Any:
        if self.header.path == path and name == "y" and self._map is not None:
            os.truncate(path, path.stat().st_size - 20)
        return real_array(self, name)

    monkeypatch.setattr(reader.SafetensorsMap, "array", cut_before_y)

    code, out, err = _diff(path.parent, b, capsys)

    assert code == 2, (out, err)
    assert str(path) in err and "'y'" in err and "truncated while being read" in err, err
