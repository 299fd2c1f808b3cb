"""benchmarks/proxy_loss.py: the proxy's cost beyond the clients' floor, from the rounds' times."""

from __future__ import annotations

import pytest

from tests.benchmarks import load_benchmark


def test_beyond_floor_by_hand() -> None:
    bench = load_benchmark("proxy_loss")
    # direct 640 ms, proxied 820 ms, floor 75 ms: 1 - 640 / 745 = 0.14094
    assert bench.beyond_floor(640.0, 820.0, 75.0) == pytest.approx(1 - 640 / 745)
    # a proxy that adds exactly the floor loses nothing
    assert bench.beyond_floor(500.0, 575.0, 75.0) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="at or below the floor"):
        bench.beyond_floor(500.0, 70.0, 75.0)


def test_an_engine_row_uses_the_medians_of_the_rounds() -> None:
    bench = load_benchmark("proxy_loss")
    run = {
        "tokens_per_round": {"direct": [1000, 1000, 1000], "proxy": [1000, 1000, 1000]},
        "rounds_direct": [2000.0, 1000.0, 4000.0],  # 500, 1000, 250 ms: median 500
        "rounds_proxy": [1000.0, 800.0, 1250.0],  # 1000, 1250, 800 ms: median 1000
        "proxy_loss": 0.5,
        "direct_tokens_per_s": 2000.0,
        "proxy_tokens_per_s": 1000.0,
    }
    row = bench.engine_row(run, floor_ms=100.0)
    assert row["direct_round_ms"] == 500.0 and row["proxied_round_ms"] == 1000.0
    assert row["proxy_loss_beyond_floor"] == pytest.approx(1 - 500 / 900, abs=1e-4)
