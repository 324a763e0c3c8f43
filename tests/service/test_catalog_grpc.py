"""Catalogs through the gRPC codec and the run file format: BeamSearchRequest.catalog, the beams'
item_id, INVALID_ARGUMENT naming the field, ModelInfo's catalogs."""

from __future__ import annotations

import json

import pytest

from service.artifact.artifact import build_artifact, load_artifact
from service.model.tokenizer import load_tokenizer
from service.runtime.engine import execute
from service.runtime.jsonl import format_result, parse_request
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import RequestError
from service.serving.grpc_codec import Codec
from service.serving.model_info import model_info


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    root = tmp_path_factory.mktemp("shop")
    (root / "shop.tsv").write_text("sku-1\t10 20 30\nsku-2\t10 20 31\nsku-3\t11 5 7\n")
    art = load_artifact(build_artifact("embedded:tiny", root / "art", quiet=True, catalogs={"shop": root / "shop.tsv"}))
    return art, PythonRuntime(art), Codec(art, load_tokenizer(art.tokenizer_dir))


def _msg(codec, **kw):
    return codec.pb2.BeamSearchRequest(prompt=codec.pb2.Segment(ids=[1, 2, 3]), **kw)


def test_beam_response_carries_item_ids(shop):
    art, runtime, codec = shop
    req, _ = codec.beam_request(_msg(codec, beam_width=8, new_tokens=3, catalog="shop"))
    (res,) = execute(art, runtime, [req])
    resp = codec.pb2.BeamSearchResponse.FromString(codec.beam_response(res))
    assert len(resp.beams) == 3  # fewer items than beams: fewer beams
    assert sorted(b.item_id for b in resp.beams) == ["sku-1", "sku-2", "sku-3"]
    want = codec.pb2.BeamSearchResponse(beams=[codec.pb2.Beam(ids=b.ids, logprob=b.logprob, item_id=b.item_id,
                                                              text=codec.tokenizer.decode(b.ids))
                                               for b in res.beams],
                                        catalog_version=art.manifest["catalogs"][0]["version"])
    assert codec.beam_response(res) == want.SerializeToString() and resp.catalog_version


@pytest.mark.parametrize("catalog,new_tokens,field", [("nope", 3, "catalog"), ("shop", 2, "new_tokens")])
def test_bad_catalog_requests_name_the_field(shop, catalog, new_tokens, field):
    codec = shop[2]
    with pytest.raises(RequestError) as e:
        codec.beam_request(_msg(codec, beam_width=2, new_tokens=new_tokens, catalog=catalog))
    assert e.value.field == field


def test_normalization_reaches_the_request_and_a_bad_one_is_named(shop):
    art, runtime, codec = shop
    req, _ = codec.beam_request(_msg(codec, beam_width=8, new_tokens=3, catalog="shop",
                                     normalization=codec.pb2.NORMALIZATION_CODES))
    assert req.normalization == "codes"
    (res,) = execute(art, runtime, [req])
    (vocab,) = execute(art, runtime, [codec.beam_request(_msg(codec, beam_width=8, new_tokens=3, catalog="shop"))[0]])
    assert sorted(b.item_id for b in res.beams) == sorted(b.item_id for b in vocab.beams)  # all 3 items both ways
    assert all(b.logprob > next(v.logprob for v in vocab.beams if v.item_id == b.item_id) for b in res.beams)
    for msg, field in ((_msg(codec, beam_width=2, new_tokens=3, normalization=codec.pb2.NORMALIZATION_CODES),
                        "normalization"),  # no catalog
                       (_msg(codec, beam_width=2, new_tokens=3, catalog="shop", normalization=7), "normalization")):
        with pytest.raises(RequestError) as e:
            codec.beam_request(msg)
        assert e.value.field == field, str(e.value)


def test_model_info_lists_catalogs(shop):
    art, runtime, codec = shop
    (cat,) = model_info(codec.pb2, "x", art, runtime).catalogs
    entry = art.manifest["catalogs"][0]
    assert (cat.name, cat.num_items, cat.code_length, cat.version) == ("shop", 3, 3, entry["version"])
    assert cat.num_codes == len({10, 20, 30, 31, 11, 5, 7}) == 7


def test_run_lines_take_catalog_and_answer_item_ids(shop):
    art, runtime, _ = shop
    req = parse_request(json.dumps({"id": "a", "kind": "beam", "prompt_ids": [4, 5], "beam_width": 2,
                                    "new_tokens": 3, "catalog": "shop"}))
    (res,) = execute(art, runtime, [req])
    beams = json.loads(format_result("a", res))["beams"]
    assert len(beams) == 2 and all(b["item_id"].startswith("sku-") for b in beams)
    with pytest.raises(RequestError, match="catalog"):
        parse_request('{"kind": "beam", "prompt_ids": [1], "beam_width": 1, "new_tokens": 3, "catalog": 7}')
    codes = parse_request(json.dumps({"id": "c", "kind": "beam", "prompt_ids": [4, 5], "beam_width": 2,
                                      "new_tokens": 3, "catalog": "shop", "normalization": "codes"}))
    assert codes.normalization == "codes" and req.normalization == "vocab"
    (res_codes,) = execute(art, runtime, [codes])
    assert [b.item_id for b in res_codes.beams] and res_codes.beams[0].logprob > res.beams[0].logprob
    with pytest.raises(RequestError, match="normalization"):
        parse_request('{"kind": "beam", "prompt_ids": [1], "beam_width": 1, "new_tokens": 3, "normalization": 1}')
