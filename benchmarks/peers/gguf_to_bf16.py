"""Rewrite a quantized GGUF with bfloat16 weights (norms stay float32, as llama.cpp's converter does).

llama.cpp then computes on the same bf16 weights as tokenloom and vLLM, not on the Q4_1 blocks,
so a peer table compares engines rather than weight formats.

    python benchmarks/peers/gguf_to_bf16.py OUT.gguf [--gguf FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from tokenloom.models.default import default_model_path

_FILE_TYPE_BF16 = 32  # llama_ftype LLAMA_FTYPE_MOSTLY_BF16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--gguf", type=Path, default=None, help="default: the embedded SmolLM2-135M-Instruct")
    args = p.parse_args()
    reader = GGUFReader(args.gguf or default_model_path())
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(args.out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer adds the header and the architecture itself
        if name == "general.file_type":
            writer.add_uint32(name, _FILE_TYPE_BF16)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)  # numpy order: slowest dim first
        kind = GGMLQuantizationType.F32 if w.ndim == 1 else GGMLQuantizationType.BF16
        data = w if kind == GGMLQuantizationType.F32 else quantize(w, kind)
        writer.add_tensor(t.name, data, raw_dtype=kind)  # BF16: the writer reads the shape off the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out} ({len(reader.tensors)} tensors)")


if __name__ == "__main__":
    main()
