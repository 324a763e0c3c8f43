"""Labels as texts, and the Tokenize RPC, over real gRPC on loopback (embedded:tiny, Python
runtime): a Score with label_texts answers as the same Score with their ids; a label text that is
not exactly one token, or label_texts beside label_ids, is INVALID_ARGUMENT naming the field;
Tokenize goes text -> ids and ids -> text as the artifact's tokenizer does, within the request
limits; `slmrank client tokenize` / `client score --label-texts` and `slmrank run`'s label_texts."""

from __future__ import annotations

import json

import grpc
import pytest

from service.cli import main as cli_main
from service.runtime.jsonl import parse_request
from service.runtime.requests import RequestError, label_ids_of_texts
from service.serving.proto_gen import load as load_stubs

pb2 = load_stubs().pb2


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value


SAMPLES = [" Trail runner 3", [1, 2, 3]]
PREFIX = "Query: running shoes. Relevant?"


def test_label_texts_score_as_their_ids(client, model):
    tok = model.tokenizer
    ids = [*tok.encode(" yes"), *tok.encode(" no")]
    assert len(ids) == 2  # one token each in the Qwen vocabulary
    by_text = client.score(SAMPLES, prefix=PREFIX, label_texts=[" yes", " no"])
    assert by_text == client.score(SAMPLES, ids, prefix=PREFIX)
    assert len(by_text.samples) == 2 and all(len(s.logprobs) == 2 for s in by_text.samples)


def test_a_label_text_of_two_tokens_is_refused_naming_it(client, model):
    two = " yes, definitely"
    n = len(model.tokenizer.encode(two))
    assert n >= 2
    e = _refused(lambda: client.score(SAMPLES, prefix=PREFIX, label_texts=[" yes", two]))
    assert e.details().startswith("label_texts[1]: ") and f"makes {n} tokens" in e.details()
    e = _refused(lambda: client.score(SAMPLES, label_texts=[" yes", ""]))  # nothing: 0 tokens
    assert e.details().startswith("label_texts[1]: ") and "makes 0 tokens" in e.details()
    e = _refused(lambda: client.score(SAMPLES, label_texts=[" yes", "x" * 10_000]))  # refused before tokenizing
    assert e.details().startswith("label_texts[1]: ") and "cannot be one token" in e.details()
    e = _refused(lambda: client.score(SAMPLES, label_texts=[" yes"] * 17))
    assert e.details() == "label_texts: 17 labels exceed the maximum of 16"


def test_label_ids_and_label_texts_together_are_refused(client):
    e = _refused(lambda: client.score(SAMPLES, [9834], label_texts=[" no"]))
    assert e.details().startswith("label_texts: both label_ids and label_texts are set")


def test_tokenize_both_ways(client, model):
    tok = model.tokenizer
    text = "The best running shoes for a marathon, ünïcode and 漢字"
    there = client.tokenize(text)
    assert list(there.ids) == tok.encode(text) and there.text == text
    back = client.tokenize(ids=list(there.ids))
    assert list(back.ids) == list(there.ids) and back.text == text
    assert list(client.tokenize(" yes").ids) == tok.encode(" yes")


def test_tokenize_refuses_as_the_other_rpcs(client, model):
    vocab = model.artifact.config.vocab_size
    most = max(model.artifact.limits.max_score_tokens, model.artifact.limits.max_prompt_tokens)
    e = _refused(lambda: client.tokenize("a", [1]))
    assert e.details().startswith("text: both text and ids are set")
    assert _refused(lambda: client.tokenize()).details().startswith("text: empty request")
    e = _refused(lambda: client.tokenize(ids=[1, vocab]))
    assert e.details() == f"ids[1]: token id {vocab} is outside the vocabulary [0, {vocab})"
    e = _refused(lambda: client.tokenize(ids=[1] * (most + 1)))
    assert e.details().startswith(f"ids: {most + 1} ids exceed the maximum of {most}")
    e = _refused(lambda: client.tokenize(" a" * (most + 1)))  # one token each: too many once tokenized
    assert e.details().startswith(f"text: tokenizes to {most + 1} tokens")


def test_client_cli_tokenize_and_label_texts(server, model, capsys):
    assert cli_main(["client", "tokenize", "--target", server.target, "--text", " yes"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ids": model.tokenizer.encode(" yes"), "text": " yes"}
    assert cli_main(["client", "tokenize", "--target", server.target, "--ids", "9834,902"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == model.tokenizer.decode([9834, 902])
    args = ["client", "score", "--target", server.target, "--timeout", "60", "--samples", " Trail runner",
            " Garden hose", "--label-texts"]
    assert cli_main([*args, " yes", " no"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["samples"]) == 2 and all(len(s["logprobs"]) == 2 for s in printed["samples"])
    assert cli_main([*args, " yes", " yes no"]) == 1
    assert "INVALID_ARGUMENT: label_texts[1]: ' yes no' makes 2 tokens" in capsys.readouterr().err


def test_run_request_files_take_label_texts(model):
    art, tok = model.artifact, model.tokenizer

    def labels_of(texts):
        return label_ids_of_texts(texts, tok.encode, art.config, art.limits)

    line = json.dumps({"id": "a", "kind": "score", "samples": [[1, 2]], "label_texts": [" yes", " no"]})
    assert parse_request(line, labels_of).label_ids == (*tok.encode(" yes"), *tok.encode(" no"))
    both = json.dumps({"kind": "score", "samples": [[1]], "label_ids": [1], "label_texts": [" no"]})
    with pytest.raises(RequestError, match="^label_texts: both label_ids and label_texts are set"):
        parse_request(both, labels_of)
    with pytest.raises(RequestError, match=r"^label_texts\[0\]: ' yes no' makes 2 tokens"):
        parse_request(json.dumps({"kind": "score", "samples": [[1]], "label_texts": [" yes no"]}), labels_of)
