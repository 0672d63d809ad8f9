"""The KV block index in C (blockcore.c says why, with the measurement): a leaf package, so that the
compiled module depends on nothing of ours.  Built by ``pip install`` (pyproject.toml), or in place by
``python scripts/build_native.py`` for a checkout that borrows another's virtualenv."""

try:
    from dynamo.kv.native.blockcore import BlockIndex, sequence_hash
except ImportError as e:  # a checkout whose C core was never built
    raise ImportError(f"dynamo.kv.native.blockcore is not built ({e}): run scripts/setup-venv.sh, or "
                      "python scripts/build_native.py in a worktree that borrows a venv") from None

__all__ = ["BlockIndex", "sequence_hash"]
