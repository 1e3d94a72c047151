"""Every graphpp schedule kind, run by PyTorch's own pipelining runtime through
graphpp.torch.schedule over gloo, gives one process's gradients (f64, within 1e-12 relative)."""

import pytest

pytest.importorskip("torch")

import graphpp  # noqa: E402
from conftest import run_cases  # noqa: E402

# Kinds PyTorch's stages can run: all but dualpipe (two parameter copies per rank).
KINDS = [name for name, *_ in graphpp.kinds() if name != "dualpipe"]


def cases(p: int) -> list[dict]:
    out = []
    for name, _, _, default_v, _ in graphpp.kinds():
        if name == "dualpipe":
            continue
        vs = sorted({1, default_v}) if name in ("interleaved-1f1b", "looped-bfs", "interleaved-zb") else [default_v]
        for v in vs:
            for m in (p, 2 * p + 1):
                case = {"kind": name, "v": v, "m": m}
                if name == "grouped-interleaved":
                    case["group"] = m  # p <= N <= m and N | m: N = m serves both m
                out.append(case)
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_kind_matches_one_process(tmp_path, ranks):
    report = run_cases(tmp_path, ranks, cases(ranks))
    ran = [r for r in report if "max_rel" in r]
    refused = [r for r in report if "error" in r]
    # Only graphpp's generator may refuse a case (a shape the kind's documented rule excludes).
    for r in refused:
        assert r["error"].startswith("GenerateError"), r
        assert r["kind"] == "dualpipev" and r["m"] < 2 * ranks, r
    for r in ran:
        assert r["max_rel"] <= 1e-12, r
    assert {r["kind"] for r in ran} == set(KINDS)
    assert {r["v"] for r in ran} == {1, 2}
