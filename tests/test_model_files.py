"""Malformed model files end in one `tokenloom: error:` line and exit status 2, never a traceback:
invalid config.json, GGUF files truncated anywhere (inside arrays too), absurd counts and lengths."""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from tokenloom.cli import main
from tokenloom.errors import ModelLoadError
from tokenloom.models.gguf_file import read_gguf

TOKENS = [f"t{i}" for i in range(40)]
TOKEN_TYPE_KEY = b"tokenizer.ggml.token_type"


def write_small_gguf(path: Path) -> Path:
    """A small valid llama GGUF: hyper-parameters, a token list, a token-type array and one tensor."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.context_length", 128)
    w.add_uint32("llama.embedding_length", 8)
    w.add_uint32("llama.attention.head_count", 2)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", TOKENS)
    w.add_array("tokenizer.ggml.token_type", [1] * len(TOKENS))
    w.add_tensor("token_embd.weight", np.zeros((len(TOKENS), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small_gguf(tmp_path: Path) -> bytes:
    data = write_small_gguf(tmp_path / "ok.gguf").read_bytes()
    read_gguf(tmp_path / "ok.gguf")  # the unmodified file parses
    return data


def _token_type_data_offset(data: bytes) -> int:
    """Offset of the token-type array's first element (key, u32 value type, u32 item type, u64 count)."""
    return data.index(TOKEN_TYPE_KEY) + len(TOKEN_TYPE_KEY) + 4 + 4 + 8


def _patch_u64(data: bytes, off: int, value: int) -> bytes:
    return data[:off] + struct.pack("<Q", value) + data[off + 8:]


def _assert_cli_error(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    rc = main(["generate", "--model", str(path), "--max-tokens", "1", "hi"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("tokenloom: error:")]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]), err
    return lines[0]


def test_gguf_truncated_inside_token_type_array(tmp_path: Path, small_gguf: bytes,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    cut = _token_type_data_offset(small_gguf) + 4 * (len(TOKENS) // 2) + 1
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(small_gguf[:cut])
    line = _assert_cli_error(bad, capsys)
    assert str(bad) in line and "truncated" in line


def test_gguf_truncated_anywhere_raises_model_load_error(tmp_path: Path, small_gguf: bytes) -> None:
    bad = tmp_path / "cut.gguf"
    for cut in range(len(small_gguf)):
        bad.write_bytes(small_gguf[:cut])
        with pytest.raises(ModelLoadError):
            read_gguf(bad)


@pytest.mark.parametrize("what", ["array_count", "tensor_count", "kv_count", "string_length", "n_dims"])
def test_gguf_absurd_counts(tmp_path: Path, small_gguf: bytes, what: str,
                            capsys: pytest.CaptureFixture[str]) -> None:
    if what == "array_count":
        data = _patch_u64(small_gguf, _token_type_data_offset(small_gguf) - 8, 2**62)
    elif what == "tensor_count":
        data = _patch_u64(small_gguf, 8, 2**60)
    elif what == "kv_count":
        data = _patch_u64(small_gguf, 16, 2**40)
    elif what == "string_length":  # the length of the first token string
        data = _patch_u64(small_gguf, small_gguf.index(b"t0") - 8, 2**63)
    else:  # the u32 dimension count after the only tensor's name
        off = small_gguf.index(b"token_embd.weight") + len(b"token_embd.weight")
        data = small_gguf[:off] + struct.pack("<I", 2**31) + small_gguf[off + 4:]
    bad = tmp_path / f"{what}.gguf"
    bad.write_bytes(data)
    with pytest.raises(ModelLoadError):
        read_gguf(bad)
    _assert_cli_error(bad, capsys)


def test_gguf_corrupted_header_bytes_raise_only_model_load_error(tmp_path: Path, small_gguf: bytes) -> None:
    header_end = small_gguf.index(b"token_embd.weight") + 40
    rng = random.Random(0)
    bad = tmp_path / "corrupt.gguf"
    for _ in range(400):
        data = bytearray(small_gguf)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(4, header_end)] = rng.randrange(256)
        bad.write_bytes(bytes(data))
        try:
            read_gguf(bad)
        except ModelLoadError:
            pass


@pytest.mark.parametrize("content", ["{not json", "", "[1, 2]", '{"architectures": ["LlamaForCausalLM"]}'])
def test_invalid_config_json(tmp_path: Path, tiny_llama: Path, content: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "config.json").write_text(content)
    line = _assert_cli_error(folder, capsys)
    assert "config.json" in line


def test_cli_subprocess_invalid_config_json_exits_2(tmp_path: Path, tiny_llama: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    exe = Path(sys.executable).with_name("tokenloom")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tokenloom.cli"]
    proc = subprocess.run([*cmd, "generate", "--model", str(folder), "hi"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("tokenloom: error:") and "invalid JSON" in lines[-1], proc.stderr
