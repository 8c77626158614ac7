"""The S3 tier's own presigning (``QuerySigner``) makes the very URLs the
tier's boto3 client makes, for each signature version and addressing style
the client uses, keys with characters that need quoting and session tokens
included; and it steps aside where the client presigns otherwise."""

from __future__ import annotations

import time
from urllib.parse import parse_qs, urlsplit

import pytest

boto3 = pytest.importorskip("boto3")
from botocore.config import Config  # noqa: E402

from kvtier.tiers.s3.presigned import QuerySigner  # noqa: E402

KEYS = ["run1/" + "ab" * 32, "pre fix/ké y+%/x~y=z&w"]


def _client(region, style="path", signature=None, token=None):
    cfg = Config(s3={"addressing_style": style}, **({"signature_version": signature} if signature else {}))
    return boto3.session.Session().client("s3", endpoint_url="http://127.0.0.1:9", region_name=region,
                                          aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="secret",
                                          aws_session_token=token, config=cfg)


def _same_second(client, signer, method, op, key):
    """The client's URL and ours, made within one clock second (signatures
    cover the time)."""
    for _ in range(5):
        t = int(time.time())
        ours = signer.sign(method, key)
        theirs = client.generate_presigned_url(op, Params={"Bucket": "kvbench", "Key": key}, ExpiresIn=900)
        if int(time.time()) == t:
            return ours, theirs
    raise AssertionError("could not make both URLs within one second")


@pytest.mark.parametrize("region,signature", [("us-east-1", None), (None, None), ("eu-west-3", None),
                                              ("us-east-1", "s3v4")])
@pytest.mark.parametrize("style", ["path", "virtual"])
@pytest.mark.parametrize("token", [None, "session-token"])
def test_our_presigned_urls_are_the_clients(region, signature, style, token):
    client = _client(region, style, signature, token)
    signer = QuerySigner.learn(client, "kvbench")
    assert signer is not None
    for key in KEYS:
        for method, op in (("GET", "get_object"), ("HEAD", "head_object")):
            ours, theirs = _same_second(client, signer, method, op, key)
            a, b = urlsplit(ours), urlsplit(theirs)
            assert (a.scheme, a.netloc, a.path) == (b.scheme, b.netloc, b.path)
            assert parse_qs(a.query) == parse_qs(b.query)


def test_a_client_that_presigns_otherwise_keeps_presigning_itself():
    class Odd:
        _request_signer = _client("eu-west-3")._request_signer  # credentials are there ...

        def __init__(self, url):
            self.url = url

        def generate_presigned_url(self, *a, **k):
            return self.url

    v4 = ("http://127.0.0.1:9/kvbench/kvtier-presign-probe?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential="
          "AKIDEXAMPLE%2F20261202%2Feu-west-3%2Fs3%2Faws4_request&X-Amz-Date=20261202T000000Z&X-Amz-Expires=900"
          "&X-Amz-SignedHeaders=host&X-Amz-Signature=00")
    assert QuerySigner.learn(Odd(v4), "kvbench") is not None
    # ... but a parameter we would not make, another algorithm, or a URL not ending in the key: not ours to sign.
    assert QuerySigner.learn(Odd(v4 + "&x-id=GetObject"), "kvbench") is None
    assert QuerySigner.learn(Odd(v4.replace("AWS4-HMAC-SHA256", "AWS4-ECDSA-P256-SHA256")), "kvbench") is None
    assert QuerySigner.learn(Odd(v4.replace("kvtier-presign-probe", "x/kvtier-presign-probe.v2")), "kvbench") is None
