"""Checkpoints on object storage (issue 38), against a real S3 server on loopback: moto's server mode, started here
(ThreadedMotoServer, a Werkzeug HTTP server speaking the S3 REST API; no mock of any client library). tensorstore's
own s3 kvstore driver talks to it over HTTP, as it would to AWS."""
from __future__ import annotations

import http.server
import subprocess
import sys
import os
import threading
from pathlib import Path

import pytest

moto_server = pytest.importorskip("moto.server")

from checkpoint import storage  # noqa: E402
from shardkit.cli import main  # noqa: E402
from shardkit.demo import build_tiny_llama  # noqa: E402
from tests.launcher import free_port  # noqa: E402

BUCKET = "shardkit-test"



@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A moto S3 server on a free loopback port, with the environment tensorstore (and the AWS tools) read."""
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    empty = tmp_path_factory.mktemp("aws") / "none"
    empty.write_text("")
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1", "AWS_CONFIG_FILE": str(empty), "AWS_SHARED_CREDENTIALS_FILE": str(empty),
           "SHARDKIT_STAGING": str(tmp_path_factory.mktemp("staging"))}
    import boto3  # moto's own dependency: only to create the bucket, as an admin would

    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        try:
            yield url
        finally:
            server.stop()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    return build_tiny_llama(d / "hf", num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=300,
                            num_attention_heads=4, num_key_value_heads=2)


def _objects(url: str) -> dict[str, bytes]:
    store = storage.ObjectStore(storage.parse(url))
    return {k: store.read(k) for k in store.list()}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line_error(capsys, rc: int) -> str:
    err = capsys.readouterr().err.strip()
    assert rc != 0
    lines = [ln for ln in err.splitlines() if ln.startswith("shardkit:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _same_iteration(objects: dict[str, bytes], local_root: Path) -> None:
    """The store's objects are the local checkpoint's files, byte for byte (the manifest aside: its provenance
    names the command and the time), and the manifests' tensor tables are equal."""
    import json

    local = _files(local_root / "iter_0000000")
    remote = {k[len("iter_0000000/"):]: v for k, v in objects.items() if k.startswith("iter_0000000/")}
    assert set(remote) == set(local)
    for k in local:
        if k != "manifest.json":
            assert remote[k] == local[k], k
    assert json.loads(remote["manifest.json"])["tensors"] == json.loads(local["manifest.json"])["tensors"]
    assert objects["latest"] == b"iter_0000000\n"


def test_convert_reshard_export_on_s3_bitwise(s3, tiny, tmp_path, capsys, monkeypatch):
    """convert hf-to-mcore to s3://, inspect and verify there, reshard s3 -> s3, mcore-to-hf from s3: every result
    equals the local-path command's, byte for byte."""
    monkeypatch.setattr(storage, "INFLIGHT_BYTES", 4096)  # uploads wait for earlier ones (the memory bound)
    args = ["--tensor-model-parallel-size", "2", "--no-verify", "--quiet"]
    assert main(["convert", "hf-to-mcore", str(tiny), f"s3://{BUCKET}/a", *args]) == 0
    assert main(["convert", "hf-to-mcore", str(tiny), str(tmp_path / "a"), *args]) == 0
    _same_iteration(_objects(f"s3://{BUCKET}/a"), tmp_path / "a")
    assert "published s3://" in capsys.readouterr().out

    assert main(["inspect", f"s3://{BUCKET}/a"]) == 0
    assert "linear_qkv" in capsys.readouterr().out
    assert main(["verify", f"s3://{BUCKET}/a"]) == 0
    out = capsys.readouterr().out  # the report names the checkpoint by its URL, not the temporary copy
    assert f"s3://{BUCKET}/a/iter_0000000: " in out and "shardkit-read-" not in out, out

    rs = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--quiet"]
    assert main(["reshard", f"s3://{BUCKET}/a", f"s3://{BUCKET}/b", *rs]) == 0
    assert main(["reshard", str(tmp_path / "a"), str(tmp_path / "b"), *rs]) == 0
    _same_iteration(_objects(f"s3://{BUCKET}/b"), tmp_path / "b")

    assert main(["convert", "mcore-to-hf", f"s3://{BUCKET}/b", str(tmp_path / "hf_s3"), "--quiet"]) == 0
    assert main(["convert", "mcore-to-hf", str(tmp_path / "b"), str(tmp_path / "hf_local"), "--quiet"]) == 0
    a, b = _files(tmp_path / "hf_s3"), _files(tmp_path / "hf_local")
    assert a.keys() == b.keys() and any(k.endswith(".safetensors") for k in a)
    assert all(a[k] == b[k] for k in a if k.endswith(".safetensors"))

    # file:// is a local path
    assert main(["inspect", f"file://{tmp_path / 'a'}"]) == 0
    # an existing checkpoint is not overwritten without --overwrite
    line = _one_line_error(capsys, main(["convert", "hf-to-mcore", str(tiny), f"s3://{BUCKET}/a", *args]))
    assert "not empty" in line and "--overwrite" in line
    # torch_dist needs a local path
    line = _one_line_error(capsys, main(["convert", "hf-to-mcore", str(tiny), f"s3://{BUCKET}/td", *args,
                                         "--format", "torch_dist"]))
    assert "torch_dist needs a local path" in line


def test_half_written_iteration_never_latest(s3, tiny, capsys):
    """An iteration prefix without manifest.json (a write killed before its manifest) is never taken: not with
    `latest` naming the committed one, not without `latest`, and a `latest` naming it is an error."""
    url = f"s3://{BUCKET}/half"
    assert main(["convert", "hf-to-mcore", str(tiny), url, "--no-verify", "--quiet"]) == 0
    store = storage.ObjectStore(storage.parse(url))
    for k in store.list("iter_0000000/"):  # iter_1: everything but the manifest
        if not k.endswith("manifest.json"):
            store.write("iter_0000001/" + k[len("iter_0000000/"):], store.read(k))
    assert storage.resolve(store) == "iter_0000000"
    store.delete_prefix("latest")
    assert storage.resolve(store) == "iter_0000000"
    assert main(["verify", url]) == 0
    store.write("latest", b"iter_0000001\n")
    line = _one_line_error(capsys, main(["inspect", url]))
    assert "iter_0000001" in line and "incomplete" in line
    store.delete_prefix("iter_0000000/manifest.json")
    store.delete_prefix("latest")
    line = _one_line_error(capsys, main(["inspect", url]))
    assert "not a shardkit checkpoint" in line and "never finished" in line


def test_damaged_object_named_by_url(s3, tiny, capsys):
    """A chunk object damaged on the store: verify is one line naming it by its URL (not the temporary copy)."""
    url = f"s3://{BUCKET}/damaged"
    assert main(["convert", "hf-to-mcore", str(tiny), url, "--no-verify", "--quiet"]) == 0
    store = storage.ObjectStore(storage.parse(url))
    chunk = next(k for k in store.list("iter_0000000/model/") if "/c/" in k)
    data = bytearray(store.read(chunk))
    data[0] ^= 0xFF
    store.write(chunk, bytes(data))
    line = _one_line_error(capsys, main(["verify", url, "--quiet"]))
    assert f"{url}/iter_0000000" in line and "shardkit-read-" not in line, line


def _nothing_complete(url: str) -> None:
    keys = storage.ObjectStore(storage.parse(url)).list()
    assert "latest" not in keys and not any(k.endswith("manifest.json") for k in keys), keys


def test_several_ranks_refused(s3, tiny, capsys, monkeypatch):
    """Object storage runs as one process: a rank of several says so before any rendezvous (no hang)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    line = _one_line_error(capsys, main(["reshard", f"s3://{BUCKET}/nothing", str(tiny.parent / "never"),
                                         "--quiet"]))
    assert "one process" in line
    assert not (tiny.parent / "never").exists()


def test_missing_bucket(s3, tiny, capsys):
    url = "s3://no-such-bucket-38/x"
    line = _one_line_error(capsys, main(["convert", "hf-to-mcore", str(tiny), url, "--no-verify", "--quiet"]))
    assert "no-such-bucket-38" in line
    line = _one_line_error(capsys, main(["inspect", url]))
    assert "no-such-bucket-38" in line
    line = _one_line_error(capsys, main(["continue-pretrain", "--load", url, "--data-path", str(tiny),
                                         "--train-iters", "1"]))
    assert "no-such-bucket-38" in line
    line = _one_line_error(capsys, main(["continue-pretrain", "--load", str(tiny), "--save", url, "--data-path",
                                         str(tiny), "--train-iters", "1"]))
    assert "no-such-bucket-38" in line


def test_wrong_credentials(s3, tiny, capsys, monkeypatch):
    """With authentication on (moto checks keys against its IAM), a key the server does not know is refused: one
    line, and the secret is never printed."""
    from moto import settings

    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-38")
    url = f"s3://{BUCKET}/creds"
    rc = main(["convert", "hf-to-mcore", str(tiny), url, "--no-verify", "--quiet"])
    line = _one_line_error(capsys, rc)
    assert "InvalidAccessKeyId" in line, line
    assert "wrong-secret-38" not in line
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
    monkeypatch.undo()
    _nothing_complete(url)


def test_bucket_that_refuses_writes(s3, tiny, tmp_path, capsys, monkeypatch):
    """Keys the server knows whose IAM policy denies s3:PutObject on the bucket (listing and reading allowed): the
    publish fails on its first object, one line, nothing on the store."""
    import json

    import boto3
    from moto import settings

    boto3.client("s3", endpoint_url=s3, region_name="us-east-1").create_bucket(Bucket="read-only-38")
    iam = boto3.client("iam", endpoint_url=s3, region_name="us-east-1")
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
            {"Effect": "Deny", "Action": "s3:PutObject", "Resource": "arn:aws:s3:::read-only-38/*"}]}))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    url = "s3://read-only-38/ck"
    line = _one_line_error(capsys, main(["convert", "hf-to-mcore", str(tiny), url, "--no-verify", "--quiet"]))
    assert "AccessDenied" in line and key["SecretAccessKey"] not in line, line
    assert storage.ObjectStore(storage.parse(url)).list() == []
    # a training run saving there: it trains, its save is refused on the first chunk object, one line
    from tests.corpus import write_pattern_corpus

    assert main(["convert", "hf-to-mcore", str(tiny), str(tmp_path / "ck"), "--no-verify", "--quiet"]) == 0
    data = write_pattern_corpus(tmp_path / "data", docs=20)
    capsys.readouterr()
    line = _one_line_error(capsys, main(["continue-pretrain", "--load", str(tmp_path / "ck"), "--save",
                                         "s3://read-only-38/run", "--data-path", str(data), "--seq-length", "16",
                                         "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1"]))
    assert "AccessDenied" in line and "latest is unchanged" in line and key["SecretAccessKey"] not in line, line
    assert storage.ObjectStore(storage.parse("s3://read-only-38/run")).list() == []


class _Throttling(http.server.BaseHTTPRequestHandler):
    def _slow_down(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _slow_down

    def log_message(self, *a):
        pass


def test_throttling_server(s3, tiny, capsys, monkeypatch):
    """A server that answers every request with 503 SlowDown: tensorstore retries (here twice), then one line."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Throttling)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("SHARDKIT_STORAGE_RETRIES", "2")
        url = f"s3://{BUCKET}/slow"
        rc = main(["convert", "hf-to-mcore", str(tiny), url, "--no-verify", "--quiet"])
        line = _one_line_error(capsys, rc)
        assert "503" in line or "SlowDown" in line or "unavailable" in line.lower(), line
        line = _one_line_error(capsys, main(["inspect", url]))
    finally:
        server.shutdown()
    monkeypatch.undo()
    _nothing_complete(f"s3://{BUCKET}/slow")


def _training_inputs(tmp_path, url: str) -> list[str]:
    """A tiny Llama converted to `url` and to tmp_path/ck, a pattern corpus; continue-pretrain's data flags."""
    import torch

    from tests.corpus import write_pattern_corpus

    hf = build_tiny_llama(tmp_path / "hf", dtype=torch.float32, num_hidden_layers=2, hidden_size=64,
                          intermediate_size=96, vocab_size=300, num_attention_heads=4, num_key_value_heads=2)
    data = write_pattern_corpus(tmp_path / "data", docs=60)
    assert main(["convert", "hf-to-mcore", str(hf), url, "--quiet", "--no-verify"]) == 0
    assert main(["convert", "hf-to-mcore", str(hf), str(tmp_path / "ck"), "--quiet", "--no-verify"]) == 0
    return ["--data-path", str(data), "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--save-interval", "1"]


def test_continue_pretrain_load_save_on_s3(s3, tmp_path, capsys):
    """continue-pretrain from s3:// to s3:// (every save published: sync, then async), resumed from the store's
    latest: the store holds what the same local-path runs write, byte for byte (chunks and train_state.json)."""
    train = _training_inputs(tmp_path, f"s3://{BUCKET}/ck")
    for load, save in ((f"s3://{BUCKET}/ck", f"s3://{BUCKET}/run"), (str(tmp_path / "ck"), str(tmp_path / "run"))):
        assert main(["continue-pretrain", "--load", load, "--save", save, *train, "--train-iters", "2"]) == 0
        assert main(["continue-pretrain", "--load", save, "--save", save, *train, "--train-iters", "3",
                     "--async-save", "--use-checkpoint-opt_param-scheduler"]) == 0
    assert not storage.staging_dir(storage.parse(f"s3://{BUCKET}/run")).exists()  # released after the run
    objects = _objects(f"s3://{BUCKET}/run")
    import json

    def log(text: str) -> list:  # both runs' iterations, appended (the time and throughput aside)
        return [(m["iteration"], m["loss"]) for m in map(json.loads, text.splitlines())]

    assert log(objects["metrics.jsonl"].decode()) == log((tmp_path / "run" / "metrics.jsonl").read_text())
    assert [i for i, _ in log(objects["metrics.jsonl"].decode())] == [1, 2, 3]
    assert objects["latest"] == b"iter_0000003\n"
    assert {k.split("/")[0] for k in objects if k.endswith("manifest.json")} == \
        {"iter_0000001", "iter_0000002", "iter_0000003"}
    local = _files(tmp_path / "run" / "iter_0000003")
    remote = {k[len("iter_0000003/"):]: v for k, v in objects.items() if k.startswith("iter_0000003/")}
    assert set(remote) == set(local)
    for k in local:
        if k == "train_state.json":
            a, b = json.loads(remote[k]), json.loads(local[k])
            a.pop("args", None), b.pop("args", None)  # the paths it was given
            assert a == b
        elif k != "manifest.json":
            assert remote[k] == local[k], k


@pytest.mark.parametrize("site", ["storage.objects", "storage.manifest"])
def test_kill_during_save_to_s3(s3, tmp_path, site):
    """kill -9 while a training save is being published (its objects there, its manifest not yet; or its manifest
    there, `latest` not yet moved): the store's `latest` still names the previous save, which loads; the rerun
    completes and moves `latest`."""
    import torch

    from tests.corpus import write_pattern_corpus

    hf = build_tiny_llama(tmp_path / "hf", dtype=torch.float32, num_hidden_layers=1, hidden_size=32,
                          intermediate_size=48, vocab_size=200, num_attention_heads=2, num_key_value_heads=1)
    data = write_pattern_corpus(tmp_path / "data", docs=40)
    url = f"s3://{BUCKET}/kill-{site}"
    assert main(["convert", "hf-to-mcore", str(hf), str(tmp_path / "ck"), "--quiet", "--no-verify"]) == 0
    argv = ["continue-pretrain", "--load", str(tmp_path / "ck"), "--save", url, "--data-path", str(data),
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--save-interval", "1",
            "--train-iters", "2"]
    env = {**os.environ, "SHARDKIT_FAULT_AT": f"{site}:2"}
    r = subprocess.run([sys.executable, "-m", "shardkit", *argv], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    store = storage.ObjectStore(storage.parse(url))
    assert store.read("latest") == b"iter_0000001\n"
    assert (store.read("iter_0000002/manifest.json") is not None) == (site == "storage.manifest")
    assert main(["verify", url, "--quiet"]) == 0  # the previous save, whole
    assert main(argv) == 0
    assert store.read("latest") == b"iter_0000002\n"
    assert main(["verify", url, "--quiet"]) == 0


def test_locations_and_specs(monkeypatch):
    """The URL forms and the kvstore specs tensorstore gets: s3 with the endpoint and region of the environment, gcs
    for gs://, never a credential; file:// is a local path; other schemes and malformed URLs are one line."""
    import json

    from checkpoint.errors import ShardkitError

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA38")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-38")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    loc = storage.parse("s3://bkt/a/b/")
    assert (loc.bucket, loc.prefix) == ("bkt", "a/b")
    spec = storage.kvstore_spec(loc, "iter_0000001")
    assert spec == {"driver": "s3", "bucket": "bkt", "path": "a/b/iter_0000001/", "endpoint": "http://127.0.0.1:9",
                    "aws_region": "eu-west-1", "aws_credentials": {"type": "environment"}}
    assert "s3cr3t-38" not in json.dumps(spec) and "AKIA38" not in json.dumps(spec)
    monkeypatch.setenv("AWS_PROFILE", "team")  # a profile: the default chain (config files), as the AWS tools
    assert "aws_credentials" not in storage.kvstore_spec(loc)
    assert storage.kvstore_spec(storage.parse("gs://g/ck")) == {"driver": "gcs", "bucket": "g", "path": "ck/"}
    assert storage.parse("file:///x/y") is None and storage.local("file:///x/y") == "/x/y"
    assert storage.parse("/local/ck") is None
    for bad in ("az://c/x", "s3://", "s3://bkt/a/../b", "msc://p/x"):
        with pytest.raises(ShardkitError, match="--load"):
            storage.parse(bad, "--load")


def test_interrupted_conversion_to_s3_resumes(s3, tiny, tmp_path):
    import json

    """kill -9 in the middle of a conversion to s3://: nothing on the store; the rerun resumes from the staging root
    (the chunks recorded before the kill are not written again) and publishes the same bytes as a local
    conversion."""
    url = f"s3://{BUCKET}/resume"
    argv = ["convert", "hf-to-mcore", str(tiny), url, "--tensor-model-parallel-size", "2", "--no-verify", "--quiet"]
    env = {**os.environ, "SHARDKIT_FAULT_AT": "chunk:4"}
    r = subprocess.run([sys.executable, "-m", "shardkit", *argv], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    assert storage.ObjectStore(storage.parse(url)).list() == []
    partial = storage.staging_dir(storage.parse(url)) / "iter_0000000.partial"
    done = len((partial / "done.log").read_text().split())
    assert done >= 4
    local = tmp_path / "local"
    assert main(["convert", "hf-to-mcore", str(tiny), str(local), "--tensor-model-parallel-size", "2", "--no-verify",
                 "--quiet"]) == 0
    tasks = len(json.loads((local / "iter_0000000" / "manifest.json").read_text())["tensors"]) and sum(
        len(e["crc32c"]) for e in json.loads((local / "iter_0000000" / "manifest.json").read_text())["tensors"]
        .values())
    # the rerun dies if it records one chunk more than the ones still missing
    env["SHARDKIT_FAULT_AT"] = f"chunk:{tasks - done + 1}"
    r = subprocess.run([sys.executable, "-m", "shardkit", *argv], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, (tasks, done, r.returncode, r.stderr[-2000:])
    _same_iteration(_objects(url), local)


def test_two_ranks_save_to_s3_killed_then_resumed(s3, tmp_path, monkeypatch):
    """continue-pretrain at TP 2 (two ranks on gloo, each with a staging root of its own: no shared directory)
    with --load and --save on s3://: each rank puts its own chunk objects, rank 0 the manifest and then `latest`.
    Rank 0 killed (-9) in the second save once every rank's objects are on the store, before its manifest.json:
    `latest` still names the first save, which verifies; the rerun resumes from the store (async saves) and the
    store ends with exactly the bytes of the same two runs on a local --save."""
    import json

    from tests.launcher import launch

    train = [*_training_inputs(tmp_path, f"s3://{BUCKET}/ck2"), "--tp", "2"]
    url = f"s3://{BUCKET}/run2"
    monkeypatch.setenv("SHARDKIT_FAULT_AT", "storage.objects:2@0")
    r = launch(2, "--load", f"s3://{BUCKET}/ck2", "--save", url, *train, "--train-iters", "2", check=False)
    monkeypatch.delenv("SHARDKIT_FAULT_AT")
    assert r.returncode != 0, r.stderr[-3000:]
    store = storage.ObjectStore(storage.parse(url))
    assert store.read("latest") == b"iter_0000001\n"
    assert "iter_0000002/manifest.json" not in store.list("iter_0000002/")  # (its first objects may be there)  # every rank's chunks, no manifest
    assert main(["verify", url, "--quiet"]) == 0  # the first save, whole
    resume = ["--train-iters", "3", "--async-save", "--use-checkpoint-opt_param-scheduler"]
    launch(2, "--load", url, "--save", url, *train, *resume)
    assert store.read("latest") == b"iter_0000003\n"

    local = tmp_path / "run"
    launch(2, "--load", str(tmp_path / "ck"), "--save", str(local), *train, "--train-iters", "2", "--exit-interval", "1")
    launch(2, "--load", str(local), "--save", str(local), *train, *resume)
    objects = _objects(url)
    for it in ("iter_0000002", "iter_0000003"):
        files = _files(local / it)
        remote = {k[len(it) + 1:]: v for k, v in objects.items() if k.startswith(it + "/")}
        assert set(remote) == set(files), it
        for k in files:
            if k == "train_state.json":
                a, b = json.loads(remote[k]), json.loads(files[k])
                a.pop("args", None), b.pop("args", None)  # the paths it was given
                # Python's own RNG is never seeded by the trainer (it draws nothing from it): a forked rank's is
                # seeded afresh from the OS (random's at-fork hook) and saved as found
                a["rng"].pop("python"), b["rng"].pop("python")
                assert a == b
            elif k == "manifest.json":
                assert json.loads(remote[k])["tensors"] == json.loads(files[k])["tensors"]  # chunk crc32c too
            else:
                assert remote[k] == files[k], (it, k)
    staging = storage.staging_dir(storage.parse(url))
    assert not staging.exists() and not (staging / "rank0").exists()  # released after the runs
    # --load's copy, shared by the node's ranks, is gone too (the killed run's, its readers dead, by the rerun)
    assert [p.name for p in (staging.parent / "read").iterdir()] == [".lock"]
    # the run's log on the store: the rerun's iterations (the killed run never got to put its own there)
    logged = [json.loads(ln) for ln in objects["metrics.jsonl"].decode().splitlines()]
    here = {m["iteration"]: m["loss"] for m in map(json.loads, (local / "metrics.jsonl").read_text().splitlines())}
    assert [(m["iteration"], m["loss"]) for m in logged] == [(2, here[2]), (3, here[3])]


def test_gs_round_trip_against_a_gcs_emulator(tiny, tmp_path, capsys, monkeypatch):
    """gs:// against a real HTTP server speaking the GCS JSON API on loopback (gcp-storage-emulator from PyPI, in
    memory), which tensorstore's gcs driver reaches through TENSORSTORE_GCS_HTTP_URL: convert hf-to-mcore to gs://,
    inspect and verify there, mcore-to-hf from it; the objects and the export equal the local-path results byte for
    byte. (The emulator ignores ifGenerationMatch: the conditional `latest` is checked on S3 only.)"""
    emulator = pytest.importorskip("gcp_storage_emulator.server")
    import logging

    port = free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket="shardkit-gs")
    server.start()
    logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
    try:
        # read once per process by tensorstore: this is the only test that opens a gs:// store
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")  # tensorstore's test-only bearer token
        monkeypatch.setenv("SHARDKIT_STAGING", str(tmp_path / "staging"))
        url = "gs://shardkit-gs/a"
        args = ["--tensor-model-parallel-size", "2", "--no-verify", "--quiet"]
        assert main(["convert", "hf-to-mcore", str(tiny), url, *args]) == 0
        assert main(["convert", "hf-to-mcore", str(tiny), str(tmp_path / "a"), *args]) == 0
        _same_iteration(_objects(url), tmp_path / "a")
        assert main(["inspect", url]) == 0
        assert "linear_qkv" in capsys.readouterr().out
        assert main(["verify", url, "--quiet"]) == 0
        assert main(["convert", "mcore-to-hf", url, str(tmp_path / "hf_gs"), "--quiet"]) == 0
        assert main(["convert", "mcore-to-hf", str(tmp_path / "a"), str(tmp_path / "hf_local"), "--quiet"]) == 0
        a, b = _files(tmp_path / "hf_gs"), _files(tmp_path / "hf_local")
        assert a.keys() == b.keys() and all(a[k] == b[k] for k in a if k.endswith(".safetensors"))
        line = _one_line_error(capsys, main(["inspect", "gs://no-such-bucket-38/x"]))
        assert "no-such-bucket-38" in line
    finally:
        server.stop()


def test_launch_passes_s3_urls_through(s3, tiny, tmp_path, capsys, monkeypatch):
    """launch with continue-pretrain's --load and --save on s3://: the layout is checked against the store's model
    (its manifest read, no arrays), nothing named s3: appears locally, the URLs reach the rendered script as given;
    with --requeue the script asks the store (`shardkit inspect`) where to resume: --load while --save holds no
    checkpoint, --save once it holds one. plan --model s3://... plans for the store's model and prints its URL as
    --load."""
    import json

    from tests.corpus import write_pattern_corpus
    from tests.launch_models import continue_pretrain_args

    monkeypatch.chdir(tmp_path)
    ck, run = f"s3://{BUCKET}/launch-ck", f"s3://{BUCKET}/launch-run"
    assert main(["convert", "hf-to-mcore", str(tiny), ck, "--no-verify", "--quiet"]) == 0
    data = write_pattern_corpus(tmp_path / "data", docs=20)
    argv = ["launch", "--layout", "tp=2", "--nodes", "1", "--gpus-per-node", "2", "--requeue", "--dry-run", "--out",
            str(tmp_path / "job"), "--", "--load", ck, "--save", run, "--data-path", str(data),
            "--micro-batch-size", "1", "--global-batch-size", "2", "--seq-length", "16"]
    capsys.readouterr()
    assert main(argv) == 0
    script = capsys.readouterr().out.split(f"# ---- {tmp_path / 'job' / 'torchrun.sh'} ----\n")[-1]
    args = continue_pretrain_args(script)
    assert args[args.index("--save") + 1] == run and '"$SHARDKIT_LOAD"' in script
    assert not any(p.name.startswith("s3") for p in tmp_path.iterdir())
    # the layout is checked against the store's model: TP 4 does not divide its 2 KV heads
    bad = [{"tp=2": "tp=4", "2": "4"}.get(a, a) if i < 7 else a for i, a in enumerate(argv)]
    line = _one_line_error(capsys, main(bad))
    assert "--tp 4 does not divide the KV heads" in line, line
    resume = script[script.index("# --requeue"):script.index("\n# the Python")]

    def load_picked(**env) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", resume + 'echo "$SHARDKIT_LOAD"'], capture_output=True, text=True,
                              env={**os.environ, "SHARDKIT_PYTHON": sys.executable,
                                   "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **env}, timeout=120)

    assert load_picked().stdout.strip() == ck
    # plan on the store's checkpoint: its model from the manifest, its URL as --load on the launch command it prints
    capsys.readouterr()
    assert main(["plan", "--model", ck, "--gpus", "2", "--seq-length", "16", "--json", "--top", "1"]) == 0
    planned = json.loads(capsys.readouterr().out)["launch"]
    assert planned[planned.index("--load") + 1] == ck, planned
    assert main(["convert", "hf-to-mcore", str(tiny), run, "--no-verify", "--quiet"]) == 0
    assert load_picked().stdout.strip() == run
    # a store that cannot be asked stops the job: never a restart from --load over newer saves
    r = load_picked(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}", SHARDKIT_STORAGE_RETRIES="0")
    assert r.returncode == 1 and "cannot tell whether" in r.stderr and r.stdout == "", r.stderr


def test_rank_killed_while_putting_its_chunks(s3, tmp_path, monkeypatch):
    """Rank 1 of 2 killed (-9) in the middle of putting its chunk objects (a resumed run's first save, iter 2):
    rank 0 hears of it (no hang), nothing of that save is complete (no manifest.json), `latest` still names
    iter 1, which verifies; the rerun resumes from it and completes."""
    import torch

    from tests.corpus import write_pattern_corpus
    from tests.launcher import launch

    hf = build_tiny_llama(tmp_path / "hf", dtype=torch.float32, num_hidden_layers=1, hidden_size=32,
                          intermediate_size=48, vocab_size=200, num_attention_heads=2, num_key_value_heads=2)
    data = write_pattern_corpus(tmp_path / "data", docs=40)
    assert main(["convert", "hf-to-mcore", str(hf), str(tmp_path / "ck"), "--quiet", "--no-verify"]) == 0
    url = f"s3://{BUCKET}/rank-killed"
    train = ["--data-path", str(data), "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
             "--save-interval", "1", "--tp", "2"]
    store = storage.ObjectStore(storage.parse(url))
    launch(2, "--load", str(tmp_path / "ck"), "--save", url, *train, "--train-iters", "1")
    monkeypatch.setenv("SHARDKIT_FAULT_AT", "store.write:2@1")  # rank 1, its first chunk object of iter 2 put
    resume = ["--train-iters", "3", "--use-checkpoint-opt_param-scheduler"]
    r = launch(2, "--load", url, "--save", url, *train, *resume, check=False)
    monkeypatch.delenv("SHARDKIT_FAULT_AT")
    assert r.returncode != 0 and "lost contact with another rank" in r.stderr, r.stderr[-3000:]
    assert f"rerun to resume from {url}/iter_0000001" in r.stderr, r.stderr[-3000:]
    assert store.read("latest") == b"iter_0000001\n"
    assert "iter_0000002/manifest.json" not in store.list("iter_0000002/")  # (its first objects may be there)
    assert main(["verify", url, "--quiet"]) == 0
    launch(2, "--load", url, "--save", url, *train, *resume)
    assert store.read("latest") == b"iter_0000003\n"
    assert main(["verify", url, "--quiet"]) == 0
