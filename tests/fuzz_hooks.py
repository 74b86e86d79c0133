"""schemathesis hooks for tests/test_fuzz_api.py (loaded through SCHEMATHESIS_HOOKS=fuzz_hooks).

Generated bodies name random models, which the server answers with 404 before anything else runs. Most
generated requests are pointed at the served model ("tiny") so they reach validation, the engine and the
streams; one in eight keeps its random name, so the 404 path is fuzzed too. Only a string is replaced by a
string: a body that breaks the schema on purpose still breaks it.
"""

from __future__ import annotations

import zlib
from typing import Any

import schemathesis

SERVED = "tiny"


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        if zlib.crc32(body["model"].encode("utf-8", "surrogatepass")) % 8:
            body["model"] = SERVED
    return body
