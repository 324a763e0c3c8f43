"""ops/bench/catalog_swap.py: its check tells a beam of the version it names from one that is not, and
one short run against a CPU server (tiny model, a small catalog) swaps the catalog under load with
every answer an item of the version it names."""

from __future__ import annotations

from types import SimpleNamespace

import grpc

from ops.bench import catalog_swap


def test_the_check_finds_beams_that_are_not_the_named_version_s_items() -> None:
    v1, v2 = catalog_swap.Items(50, 28), catalog_swap.Items(50, 29)
    ids = v1.ids[7].tolist()
    assert v1.holds("i07", ids) and not v2.holds("i07", ids)  # the same item id, another code in v2
    assert not v1.holds("i08", ids) and not v1.holds("i99", ids) and not v1.holds("x07", ids)

    def answer(version: str, item: str, beam_ids: list[int]) -> SimpleNamespace:
        return SimpleNamespace(catalog_version=version, beams=[SimpleNamespace(item_id=item, ids=beam_ids)])

    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "overloaded"

    swap = [{"start_s": 1.0, "end_s": 2.0}]
    r = catalog_swap.check([(0.0, 0.5, answer("a", "i07", ids)), (1.5, 2.5, answer("b", "i07", ids)),
                            (0.0, 0.1, answer("c", "i07", ids)), (0.0, 0.1, Refused())],
                           {"a": v1, "b": v2}, swap)
    assert r["codes"] == {"OK": 3, "UNAVAILABLE": 1}
    assert r["beams_checked"] == 2 and r["invalid"] == 2  # v2's i07 is another code; "c" is no version
    assert r["answers_per_version"] == {"a": 1, "b": 1}
    assert r["latency_overlapping_a_swap"]["n"] == 1 and r["latency_otherwise"]["n"] == 1


def test_a_short_run_against_a_cpu_server(tmp_path) -> None:
    r = catalog_swap.main(["--model", "embedded:tiny", "--items", "400", "--prompt", "8", "--beam", "2",
                           "--clients", "2", "--duration-s", "3", "--swaps", "2", "--device", "cpu",
                           "--out", str(tmp_path)])
    assert set(r["codes"]) == {"OK"} and r["codes"]["OK"] > 0 and r["invalid"] == 0 and r["beams_checked"] > 0
    assert [s["file"] for s in r["swaps"]] == ["v2.tsv", "v1.tsv"]
    first, second = (s["version"] for s in r["swaps"])
    assert first != second and set(r["answers_per_version"]) == {first, second}
