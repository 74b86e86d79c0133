"""Disaggregated prefill and decode: a prefill worker computes a prompt's KV blocks and ships them to a
decode worker, which continues from them as if it had computed them itself (prefix-cache hits).

- `blocks.py`: read a prompt's cached blocks out of an engine, write received blocks into one.
- `wire.py`: the transfer's wire format, with the checks made on arrival.
- `transfer.py`: the ZeroMQ sender (prefill side) and receiver (decode side).
"""
