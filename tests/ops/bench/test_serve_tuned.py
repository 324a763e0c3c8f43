"""ops/bench/serve_tuned.py: the scheduler's internal constants changed for a policy measurement."""

from __future__ import annotations

import dataclasses

import pytest

from ops.bench.serve_tuned import main, override, apply
from service.sched.admission import AdmissionConfig
from service.sched.batcher import BatcherConfig


@pytest.fixture
def restore_defaults():
    saved = {c: (c.__init__.__defaults__, {f.name: f.default for f in dataclasses.fields(c)})
             for c in (BatcherConfig, AdmissionConfig)}
    yield
    for c, (defaults, fields) in saved.items():
        c.__init__.__defaults__ = defaults
        for f in dataclasses.fields(c):
            f.default = fields[f.name]


def test_a_set_default_reaches_every_later_config_and_an_explicit_value_still_wins(restore_defaults):
    before = BatcherConfig()
    for spec in ("batcher.load_wait_share=0.6", "batcher.max_inflight=3", "batcher.validate_requests=false"):
        apply(*override(spec))
    after = BatcherConfig()
    assert (after.load_wait_share, after.max_inflight, after.validate_requests) == (0.6, 3, False)
    # the fields not named keep theirs
    assert after.load_wait_max_s == before.load_wait_max_s and after.heavy_batch_s == before.heavy_batch_s
    assert BatcherConfig(load_wait_share=0.1).load_wait_share == 0.1
    assert {f.name: f.default for f in dataclasses.fields(BatcherConfig)}["load_wait_share"] == 0.6


@pytest.mark.parametrize("spec, words", [
    ("batcher.nope=1", "no field 'nope'"),
    ("load_wait_share=0.5", "SECTION.FIELD=VALUE"),
    ("engine.max_inflight=2", "SECTION.FIELD=VALUE"),
    ("batcher.max_inflight=two", "takes a int"),
    ("batcher.validate_requests=1", "true or false"),
])
def test_a_wrong_set_names_what_is_wrong(spec, words):
    with pytest.raises(ValueError, match=words):
        override(spec)


def test_a_wrong_set_is_one_line_and_exit_2_before_anything_is_served(capsys, restore_defaults):
    assert main(["--set", "batcher.nope=1", "--", "--model", "embedded:tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no field 'nope'" in err[0]
    assert BatcherConfig().max_inflight == 2
