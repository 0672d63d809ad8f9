"""The mocker's arguments (``--extra-engine-args`` JSON, Dynamo's mocker keys): the keys, defaults and checks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from dynamo.errors import UserError


@dataclass(frozen=True)
class MockerArgs:
    num_gpu_blocks: int = 16384
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    watermark: float = 0.01
    speedup_ratio: float = 1.0
    # decode steps only, on top of speedup_ratio (Dynamo's mocker: speculative decoding's faster decode)
    decode_speedup_ratio: float = 1.0
    dp_size: int = 1
    # disaggregated serving (docs/disaggregation.md): the KV state a prefill worker hands over, per prompt
    # token, and the link it crosses; 128 KiB/token is Llama-3-8B in f16, 25 GB/s an RDMA NIC's order
    kv_bytes_per_token: int = 131072
    kv_transfer_bandwidth_gbps: float = 25.0  # gigabytes per second
    kv_transfer_latency_ms: float = 1.0

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "MockerArgs":
        """Checked construction: unknown keys and values of the wrong type or range are a UserError."""
        data = dict(data or {})
        valid = cls.valid_keys()
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise UserError(f"--extra-engine-args: unknown mocker argument(s) {', '.join(unknown)}; "
                            f"valid keys: {', '.join(valid)}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            v = data[f.name]
            if f.type in ("bool", bool):
                if not isinstance(v, bool):
                    raise UserError(f"--extra-engine-args: mocker argument {f.name} must be true or false, not {v!r}")
            elif f.type in ("int", int):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise UserError(f"--extra-engine-args: mocker argument {f.name} must be an integer, not {v!r}")
            else:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise UserError(f"--extra-engine-args: mocker argument {f.name} must be a number, not {v!r}")
                v = float(v)
            values[f.name] = v
        args = cls(**values)
        args.check()
        return args

    def check(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "dp_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--extra-engine-args: mocker argument {name} must be at least 1, not {getattr(self, name)}")
        if not 0 <= self.watermark < 1:
            raise UserError(f"--extra-engine-args: mocker argument watermark must be in [0, 1), not {self.watermark}")
        if not self.kv_transfer_bandwidth_gbps > 0 or self.kv_transfer_latency_ms < 0:
            raise UserError("--extra-engine-args: mocker kv_transfer_bandwidth_gbps must be > 0 and "
                            "kv_transfer_latency_ms >= 0")
        for name in ("speedup_ratio", "decode_speedup_ratio"):
            if not getattr(self, name) > 0:
                raise UserError(f"--extra-engine-args: mocker argument {name} must be > 0, not {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
