"""Checkpoint locations: local paths and object storage (`s3://bucket/prefix`, `gs://bucket/prefix`), in one place.

Object storage goes through tensorstore's own kvstore drivers (`s3`, `gcs`: `ts.KvStore`), the same layer its zarr3
driver reads arrays through; no second client library. Endpoint, region and credentials are taken the way the AWS
tools take them (tensorstore's s3 driver reads `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`,
`AWS_PROFILE` with `~/.aws/credentials` and `~/.aws/config`, and the instance metadata service); `AWS_ENDPOINT_URL`
(`AWS_ENDPOINT_URL_S3` first) and `AWS_REGION` (`AWS_DEFAULT_REGION`) are passed on as the spec's `endpoint` and
`aws_region`. Credentials are never put in a spec, a message or a log. GCS takes Google's application default
credentials.

A command writes a checkpoint to object storage through a local staging root (`SHARDKIT_STAGING`, default
`$TMPDIR/shardkit-staging/<hash of the URL>`): the ordinary writer and commit protocol run there (so an interrupted
conversion resumes from the staging root's `iter_N.partial`, redoing only missing chunks), and `publish` then puts the
committed iteration on the store: every object of the iteration but `manifest.json`, then `manifest.json`, then the
pointer `latest` (a conditional write against the generation read before, so two writers cannot both move it). A
store has no rename: an iteration prefix without `manifest.json` is never a checkpoint, and `latest` is written
last. Reading (`fetch`) resolves the iteration as `iterations.resolve_iteration` does locally and downloads it into a
temporary root the readers check as usual (digest, every chunk's crc32c). docs/FORMAT.md "Object storage".
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import FormatError, ShardkitError, WriteError
from .faults import fault_point

SCHEMES = {"s3": "s3", "gs": "gcs"}  # URL scheme -> tensorstore kvstore driver
LATEST = "latest"
MANIFEST = "manifest.json"
TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_\d{7}$")
INFLIGHT_BYTES = 256 << 20  # bytes of uploads/downloads in flight at once (memory bound)
TORCH_DIST_REFUSED = "torch_dist needs a local path; use the native format for {scheme}:// (--format native)"


@dataclass(frozen=True)
class Location:
    url: str
    scheme: str
    bucket: str
    prefix: str  # without leading or trailing '/'; '' is the bucket's root

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel


def parse(value: object, flag: str = "") -> Location | None:
    """The object-storage location a path argument (`flag`) names, or None for a local path (`file://` included:
    see `local`). Any other scheme (`https://`, `msc://`) is one line."""
    if not isinstance(value, str) or "://" not in value:
        return None
    scheme, _, rest = value.partition("://")
    if scheme == "file":
        return None
    if scheme not in SCHEMES:
        raise ShardkitError(f"{flag + ' ' if flag else ''}{value}: {scheme}:// is not supported; a checkpoint "
                            "location is a local path, file://, s3://bucket/prefix or gs://bucket/prefix")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or any(p in ("", ".", "..") for p in prefix.split("/") if prefix) or "\\" in prefix:
        raise ShardkitError(f"{flag + ' ' if flag else ''}{value}: not a {scheme}://bucket/prefix location")
    return Location(value, scheme, bucket, prefix)


def local(value: str) -> str:
    """A local path argument with `file://` removed."""
    return value[len("file://"):] if isinstance(value, str) and value.startswith("file://") else value


def kvstore_spec(loc: Location, sub: str = "") -> dict:
    """The tensorstore kvstore spec of `loc` (plus `sub`, a key prefix below it): no credentials in it."""
    path = loc.key(sub) if sub else loc.prefix
    spec: dict = {"driver": SCHEMES[loc.scheme], "bucket": loc.bucket, "path": path + "/" if path else ""}
    if loc.scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
        if region:
            spec["aws_region"] = region
        if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY") and \
                not os.environ.get("AWS_PROFILE"):
            # keys in the environment win, as for the AWS tools; naming that provider also spares stderr the default
            # chain's log lines about a missing ~/.aws/config (the values stay in the environment, not in the spec)
            spec["aws_credentials"] = {"type": "environment"}
        retries = os.environ.get("SHARDKIT_STORAGE_RETRIES")  # tensorstore's default: 32 with backoff
        if retries:
            spec["context"] = {"s3_request_retries": {"max_retries": int(retries), "initial_delay": "100ms",
                                                      "max_delay": "1s"}}
    return spec


def _error(loc: Location, what: str, e: BaseException, cls=ShardkitError) -> ShardkitError:
    msg = " ".join(str(e).split())  # one line; tensorstore's messages name the key and the HTTP status
    body = re.search(r"<Code>([^<]*)</Code>\s*(?:<Message>([^<]*)</Message>)?", msg)
    if body:  # an S3 error document: its code and message, not the XML
        msg = msg[:msg.index(":")] + ": " + ": ".join(x for x in body.groups() if x)
    msg = re.sub(r"\s*\[source locations=.*?\]", "", msg)
    if len(msg) > 300:
        msg = msg[:300] + "..."
    return cls(f"{loc.url}: {what} failed ({msg})")


class ObjectStore:
    """Small-object operations on one location (keys relative to its prefix), through ts.KvStore."""

    def __init__(self, loc: Location):
        import tensorstore as ts

        self.loc = loc
        self._ts = ts
        try:
            self.kv = ts.KvStore.open(kvstore_spec(loc)).result()
        except Exception as e:
            raise _error(loc, "opening the store", e) from None

    def read(self, key: str) -> bytes | None:
        return self.read_stamped(key)[0]

    def read_stamped(self, key: str) -> tuple[bytes | None, bytes]:
        """(value or None when missing, generation) of one object."""
        try:
            r = self.kv.read(key).result()
        except Exception as e:
            raise _error(self.loc, f"reading {key}", e, FormatError) from None
        return (bytes(r.value) if r.state == "value" else None), r.stamp.generation

    def write(self, key: str, data: bytes, if_equal: bytes | None = None) -> bool:
        """Write one object; with `if_equal`, only if its generation is still that (False when it is not)."""
        try:
            kw = {} if if_equal is None else {"if_equal": if_equal}
            stamp = self.kv.write(key, data, **kw).result()
        except Exception as e:
            raise _error(self.loc, f"writing {key}", e, WriteError) from None
        return bool(stamp.generation)

    def list(self, prefix: str = "") -> list[str]:
        """The keys starting with `prefix`. Filtered here too: a server that ignores the listing's range (the GCS
        emulator returns every key) must not make `latest` look like an object of an iteration."""
        try:
            rng = self._ts.KvStore.KeyRange(prefix, _successor(prefix)) if prefix else self._ts.KvStore.KeyRange()
            return sorted(k for k in (k.decode() for k in self.kv.list(rng).result()) if k.startswith(prefix))
        except Exception as e:
            raise _error(self.loc, f"listing {prefix or '/'}", e, FormatError) from None

    def delete(self, key: str) -> None:
        try:
            self.kv.write(key, None).result()
        except Exception as e:
            raise _error(self.loc, f"deleting {key}", e, WriteError) from None

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object whose key starts with `prefix`: the keys listed (and filtered) here, then deleted one
        by one in parallel, never a range the server might widen."""
        keys = self.list(prefix)
        try:
            for fut in [self.kv.write(k, None) for k in keys]:
                fut.result()
        except Exception as e:
            raise _error(self.loc, f"deleting {prefix}", e, WriteError) from None

    def upload(self, files: list[tuple[Path, str]], bar=None) -> None:
        """Write local files as objects, in parallel, with at most INFLIGHT_BYTES read into memory at once (`bar`:
        a checkpoint.progress bar advanced in bytes)."""
        pending: deque = deque()  # (future, size), oldest first
        held = 0
        try:
            for path, key in files:
                size = path.stat().st_size
                while pending and held + size > INFLIGHT_BYTES:
                    fut, n = pending.popleft()
                    fut.result()
                    held -= n
                    if bar is not None:
                        bar.advance(n, 1)
                pending.append((self.kv.write(key, path.read_bytes()), size))
                held += size
            while pending:
                fut, n = pending.popleft()
                fut.result()
                if bar is not None:
                    bar.advance(n, 1)
        except OSError as e:
            raise WriteError(f"{e.filename or self.loc.url}: reading the staged file failed ({e.strerror or e})") \
                from None
        except Exception as e:
            raise _error(self.loc, "writing the checkpoint's objects", e, WriteError) from None

    def download(self, keys: list[str], dest: Path, strip: str = "", bar=None) -> None:
        """Objects `keys` into files below `dest` (each key less `strip`), in parallel, bounded in memory."""
        from .safety import safe_path

        pending: deque = deque()

        def drain(n: int) -> None:
            while len(pending) > n:
                fut, path, key = pending.popleft()
                r = fut.result()
                if r.state != "value":
                    raise FormatError(f"{self.loc.url}/{key}: disappeared while reading the checkpoint")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(bytes(r.value))
                if bar is not None:
                    bar.advance(len(r.value), 1)

        try:
            for key in keys:
                path = safe_path(dest, key[len(strip):], f"{self.loc.url}/{key}")
                pending.append((self.kv.read(key), path, key))
                drain(16)
            drain(0)
        except ShardkitError:
            raise
        except Exception as e:
            raise _error(self.loc, "reading the checkpoint's objects", e, FormatError) from None


def _successor(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else ""  # "": the end of the key space


def resolve(store: ObjectStore) -> str:
    """The iteration (`iter_NNNNNNN`, or '' when the location is an iteration itself) a reader takes, by the rules
    of iterations.resolve_iteration: `latest` wins and must name an iteration whose manifest.json exists; without it,
    the newest iteration with a manifest; an iteration prefix without manifest.json (a write that never finished) is
    never taken."""
    loc = store.loc
    if store.read(MANIFEST) is not None:
        return ""
    if store.read(TRACKER) is not None:
        raise ShardkitError(f"{loc.url}: a torch_dist checkpoint; " + TORCH_DIST_REFUSED.format(scheme=loc.scheme))
    text = store.read(LATEST)
    if text is not None:
        name = text[:4096].decode(errors="replace").strip()
        if not _ITER.match(name):
            raise FormatError(f"{loc.url}/{LATEST}: names {name[:80]!r}, not an iteration (iter_NNNNNNN)")
        if store.read(f"{name}/{MANIFEST}") is None:
            raise FormatError(f"{loc.url}/{LATEST}: points to {name}, which is missing or incomplete")
        return name
    keys = store.list()
    done = sorted({k.split("/")[0] for k in keys if k.count("/") == 1 and k.endswith("/" + MANIFEST)
                   and _ITER.match(k.split("/")[0])})
    if done:
        return done[-1]
    started = sorted({k.split("/")[0] for k in keys if _ITER.match(k.split("/")[0])})
    hint = f" (only {started[-1]} without {MANIFEST}: a write that never finished)" if started else ""
    raise FormatError(f"{loc.url}: not a shardkit checkpoint: no {LATEST} and no {MANIFEST}{hint}")


ARRAY_DIRS = ("model/", "optim/")  # an iteration's arrays; the rest is its small files (manifest, state, hf/)


def fetch(loc: Location, dest: Path, arrays: bool = True, quiet: bool = False, name: str | None = None) -> Path:
    """Download the iteration a reader takes at `loc` (or `name`, resolved already) into `dest/<iter>` (with
    `dest/latest` naming it) and return the local root; the readers then check it as any local checkpoint.
    `arrays=False`: only its small files (what `inspect` reads)."""
    store = ObjectStore(loc)
    name = resolve(store) if name is None else name
    strip = name + "/" if name else ""
    if not name:  # the URL is an iteration itself
        name = loc.prefix.rsplit("/", 1)[-1] if _ITER.match(loc.prefix.rsplit("/", 1)[-1]) else "iter_0000000"
    keys = store.list(strip)
    if not arrays:
        keys = [k for k in keys if not k[len(strip):].startswith(ARRAY_DIRS)]
    from .progress import progress_bar

    with progress_bar(f"reading {loc.url}", None, len(keys), disable=quiet or not arrays, unit="objects") as bar:
        store.download(keys, dest / name, strip=strip, bar=bar)  # (sizes unknown before reading: no total)
    (dest / LATEST).write_text(name + "\n")
    return dest


def publish(local_root: Path, loc: Location, quiet: bool = True) -> str:
    """Put the committed iteration `latest` names in `local_root` on the store: its objects, then manifest.json,
    then `latest` (conditional on the generation read first). An existing iteration of that name there first loses
    its manifest.json (it stops being complete), then its objects."""
    from .iterations import resolve_iteration

    it = resolve_iteration(local_root)
    name = it.name
    store = ObjectStore(loc)
    generation = unpublish(store, name)
    files = sorted(p for p in it.rglob("*") if p.is_file() and p != it / MANIFEST)
    from .progress import progress_bar

    with progress_bar(f"publishing {loc.url}", sum(p.stat().st_size for p in files), len(files), disable=quiet,
                      unit="objects") as bar:
        store.upload([(p, f"{name}/{p.relative_to(it).as_posix()}") for p in files], bar)
    fault_point("storage.objects")
    store.upload([(it / MANIFEST, f"{name}/{MANIFEST}")])
    fault_point("storage.manifest")
    if not store.write(LATEST, f"{name}\n".encode(), if_equal=generation):
        raise WriteError(f"{loc.url}/{LATEST}: another writer moved it while {name} was being written; {name} is "
                         "complete on the store but not the latest")
    return f"{loc.url.rstrip('/')}/{name}"


def unpublish(store: ObjectStore, name: str) -> bytes:
    """Make room for a new write of iteration `name`: an existing one of that name first loses its manifest.json
    (it stops being complete), then its objects. When `latest` names it (a rerun saving the iteration it resumed
    from), `latest` first moves to the newest other complete iteration, or goes when there is none, so a kill during
    the rewrite never leaves a `latest` naming an incomplete iteration. Returns the generation of `latest` that the
    publish's conditional write of it expects."""
    text, generation = store.read_stamped(LATEST)
    if not store.list(name + "/"):
        return generation
    if text is not None and text[:64].decode(errors="replace").strip() == name:
        keys = store.list()
        others = sorted({k.split("/")[0] for k in keys if k.count("/") == 1 and k.endswith("/" + MANIFEST)
                         and _ITER.match(k.split("/")[0]) and k.split("/")[0] != name})
        if others:
            if not store.write(LATEST, f"{others[-1]}\n".encode(), if_equal=generation):
                raise WriteError(f"{store.loc.url}/{LATEST}: another writer moved it while {name} was being replaced")
        else:
            store.delete(LATEST)
        generation = store.read_stamped(LATEST)[1]
    store.delete(f"{name}/{MANIFEST}")
    store.delete_prefix(name + "/")
    return generation


def staging_dir(loc: Location) -> Path:
    """The local root standing for `loc` (a conversion's staging root; a training run's --save root, where only a
    resumed run's download of the store's latest lies). One per rank when several run: ranks share no directory."""
    base = os.environ.get("SHARDKIT_STAGING") or os.path.join(tempfile.gettempdir(), "shardkit-staging")
    root = Path(base) / hashlib.sha256(loc.url.rstrip("/").encode()).hexdigest()[:16]
    return root / f"rank{_rank()}" if _world() > 1 else root


def _world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


# -- the CLI's checkpoint arguments -----------------------------------------------------------------------------------

def _one_process(url: str) -> None:
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        try:
            if int(os.environ.get(var, "1")) > 1:
                raise ShardkitError(f"{url}: object storage runs as one process for now ({var}={os.environ[var]}); "
                                    "start it without torchrun/srun, or use a shared filesystem")
        except ValueError:
            pass


@contextlib.contextmanager
def reading(value: str, arrays: bool = True, quiet: bool = False, ranks: bool = False) -> Iterator[str]:
    """A checkpoint argument to read: a local path as given (file:// removed), or a temporary local copy of the
    iteration an object-storage location resolves to (`arrays=False`: its small files only), removed afterwards.
    `ranks`: the command may run as several ranks (continue-pretrain: each rank reads its own copy)."""
    loc = parse(value)
    if loc is None:
        yield local(value)
        return
    if not ranks:
        _one_process(value)
    if ranks and _world() > 1 and arrays:
        with _node_copy(loc, quiet) as root, _named_as(root, value):
            yield str(root)
        return
    tmp = Path(tempfile.mkdtemp(prefix="shardkit-read-"))
    try:
        with _named_as(tmp, value):
            yield str(fetch(loc, tmp, arrays, quiet))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _named_as(copy: Path, url: str) -> Iterator[None]:
    """While a command reads the local copy `copy` of `url`, what it says names the URL, not the copy: its errors
    (a damaged object, by its URL) and its output (`verify`'s and `inspect`'s report, the trainer's `loaded
    checkpoint` line)."""
    import sys

    old, new = str(copy), url.rstrip("/")

    class Renamed:
        def __init__(self, out):
            self._out = out

        def write(self, text: str) -> int:
            self._out.write(text.replace(old, new))
            return len(text)

        def __getattr__(self, name):
            return getattr(self._out, name)

    try:
        with contextlib.redirect_stdout(Renamed(sys.stdout)):
            yield
    except ShardkitError as e:
        e.args = tuple(a.replace(old, new) if isinstance(a, str) else a for a in e.args)
        raise


@contextlib.contextmanager
def _node_copy(loc: Location, quiet: bool) -> Iterator[Path]:
    """The local copy of the iteration `loc` resolves to that the ranks of one node share (continue-pretrain --load
    on several ranks): `<staging base>/read/<sha256 of URL, iteration and manifest>[:16]`. Under one lock file per
    node the first rank downloads it and the others find it complete (`.complete`, written last); each rank records
    itself in `<copy>.users/<pid>` while it reads, and the last one out removes the copy. Copies whose readers all
    died (a killed run) are removed by the next rank that takes the lock."""
    import fcntl

    base = Path(os.environ.get("SHARDKIT_STAGING") or os.path.join(tempfile.gettempdir(), "shardkit-staging")) / "read"
    store = ObjectStore(loc)
    name = resolve(store)
    manifest = store.read(f"{name}/{MANIFEST}" if name else MANIFEST) or b""
    key = hashlib.sha256(b"\0".join([loc.url.rstrip("/").encode(), name.encode(), manifest])).hexdigest()[:16]
    root, users = base / key, base / f"{key}.users"

    @contextlib.contextmanager
    def locked():
        base.mkdir(parents=True, exist_ok=True)
        with open(base / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def ours(name: str) -> bool:  # a node copy or its readers' directory (a 16-hex key): nothing else is removed
        return re.fullmatch(r"[0-9a-f]{16}(\.users)?", name) is not None

    def prune() -> None:  # copies nobody alive reads any more
        for u in (u for u in base.glob("*.users") if ours(u.name)):
            for p in u.iterdir():
                if not _alive(p.name):
                    p.unlink(missing_ok=True)
            if not any(u.iterdir()):
                shutil.rmtree(base / u.name.removesuffix(".users"), ignore_errors=True)
                with contextlib.suppress(OSError):
                    u.rmdir()
        for d in base.iterdir():  # a download killed before it recorded a reader
            if ours(d.name) and d.is_dir() and not d.name.endswith(".users") and \
                    not (base / f"{d.name}.users").exists():
                shutil.rmtree(d, ignore_errors=True)

    me = users / str(os.getpid())
    with locked():
        prune()
        users.mkdir(exist_ok=True)
        me.touch()
        if not (root / ".complete").is_file():
            shutil.rmtree(root, ignore_errors=True)
            try:
                fetch(loc, root, True, quiet, name=name)
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)
                me.unlink(missing_ok=True)
                raise
            (root / ".complete").write_text(name + "\n")
    try:
        yield root
    finally:
        with locked():
            me.unlink(missing_ok=True)
            prune()


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


class Writing:
    """A checkpoint argument to write: `path` is the local root the writer uses (the staging root for object
    storage); `publish()` puts its committed iteration on the store."""

    def __init__(self, value: str, overwrite: bool = False, flag: str = "OUT", ranks: bool = False):
        self.loc = parse(value)
        self.value = value
        self.path = str(staging_dir(self.loc)) if self.loc else local(value)
        if self.loc is None:
            return
        if not ranks:  # (a training save: every rank writes its own objects, train/checkpointing.py)
            _one_process(value)
        keys = ObjectStore(self.loc).list()
        if keys and not overwrite:
            raise ShardkitError(f"{flag} {value}: the location is not empty ({', '.join(keys[:3])}"
                                f"{', ...' if len(keys) > 3 else ''}); pass --overwrite to write a checkpoint there")
        root = Path(self.path)  # only an interrupted write (iter_N.partial) is worth keeping: it resumes
        if root.is_dir():
            for p in root.iterdir():
                if not p.name.endswith(".partial"):
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        self.remote_has_checkpoint = bool(keys)

    def publish(self, quiet: bool = False) -> str | None:
        if self.loc is None:
            return None
        url = publish(Path(self.path), self.loc, quiet)
        shutil.rmtree(self.path, ignore_errors=True)
        return url


# -- training saves: every commit of a mirrored root is published ----------------------------------------------------

_MIRRORS: dict[str, Location] = {}


RUN_LOG = "metrics.jsonl"  # the run's log in --save (train/metrics.py), appended to by every resumed run
_FETCHED: dict[str, bytes | None] = {}  # a mirrored root -> the store's RUN_LOG as it came down


def mirror(local_root: str, loc: Location) -> None:
    """A training run's --save root stands for `loc`: its saves go to the store (train/checkpointing.py), and its
    run files (metrics.jsonl, TensorBoard events) are written here and put on the store by `release`; the store's
    metrics.jsonl comes down first, so that this run appends to it as a local --save's run does."""
    _MIRRORS[os.path.realpath(local_root)] = loc
    text = _FETCHED[os.path.realpath(local_root)] = ObjectStore(loc).read(RUN_LOG)
    if text is not None:
        Path(local_root).mkdir(parents=True, exist_ok=True)
        (Path(local_root) / RUN_LOG).write_bytes(text)


def release(local_root: str, failed: bool = False) -> None:
    """The end of a run that mirrored `local_root` (finished, or `failed`: its error is the run's one line): every
    save is on the store already; the run files written here go there too, then the staging root."""
    loc = _MIRRORS.pop(os.path.realpath(local_root), None)
    if loc is not None:
        root = Path(local_root)
        fetched = _FETCHED.pop(os.path.realpath(local_root), None)
        files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
                       and not _ITER.match(p.relative_to(root).parts[0].removesuffix(".partial"))
                       and p.relative_to(root).parts[0] != LATEST) if root.is_dir() else []
        # a rank that does not write the log holds the store's copy as it came down: never put back over the new one
        files = [p for p in files if not (p == root / RUN_LOG and p.read_bytes() == fetched)]
        if files:
            try:
                ObjectStore(loc).upload([(p, p.relative_to(root).as_posix()) for p in files])
            except ShardkitError as e:  # the saves are on the store; the log is not worth failing the run for
                if not failed:
                    import sys

                    sys.stderr.write(f"shardkit: warning: the run's files in {root} were not put on the store ({e});"
                                     " they stay there\n")
                return
        shutil.rmtree(local_root, ignore_errors=True)
        if _world() > 1:  # <hash>/rank<N>: the last rank out removes <hash>
            with contextlib.suppress(OSError):
                Path(local_root).parent.rmdir()


def committed(root: Path) -> None:
    """Called by commit.IterationWriter.commit after `latest` was written: a root mirrored to object storage (a
    training --save s3://...) publishes the new iteration."""
    loc = _MIRRORS.get(os.path.realpath(root))
    if loc is not None:
        publish(root, loc)


# -- training saves written straight to the store (continue-pretrain --save s3://..., any number of ranks) -----------

def mirrored(local_root) -> Location | None:
    """The object-storage location a training run's --save root stands for (None: a local --save)."""
    return _MIRRORS.get(os.path.realpath(local_root)) if local_root else None


def shown(local_root, name: str = "") -> str:
    """How a message names the --save root (or its iteration `name`): the URL when it stands for object storage."""
    loc = mirrored(local_root)
    if loc is None:
        return str(Path(local_root) / name) if name else str(local_root)
    return f"{loc.url.rstrip('/')}/{name}" if name else loc.url


def last_complete(local_root) -> str:
    """The checkpoint a reader of the --save root takes now (its URL on object storage); ShardkitError when none."""
    loc = mirrored(local_root)
    if loc is None:
        from .iterations import resolve_iteration

        return str(resolve_iteration(local_root))
    return f"{loc.url.rstrip('/')}/{resolve(ObjectStore(loc))}"


def put_chunks(loc: Location, items: list) -> list[int]:
    """Write chunk objects straight from memory: `items` is [(key below `loc`, value: a torch tensor or numpy array
    of the chunk's full shape)], each object the chunk's little-endian bytes followed by their crc32c (exactly
    chunkio's chunk file, the zarr3 `bytes` + `crc32c` codecs). Parallel, with at most INFLIGHT_BYTES of objects
    held at once (waiting on the oldest). Returns every chunk's crc32c, in the order of `items`. A failure is one
    WriteError naming the location; a chunk object already written stays (no manifest names it)."""
    import numpy as np

    from . import chunkio, store

    if not chunkio.AVAILABLE:
        raise WriteError(f"{loc.url}: writing to object storage needs the crc32c package (pip install crc32c)")
    s = ObjectStore(loc)
    pending: deque = deque()
    held, crcs = 0, []
    try:
        for key, value in items:
            fault_point("store.write")  # the site every writer of array bytes passes (a kill between chunks)
            raw = np.ascontiguousarray(store.to_numpy(value)).reshape(-1).view(np.uint8)
            crc = chunkio.crc(raw)
            data = raw.tobytes() + crc.to_bytes(chunkio.TRAILER, "little")
            while pending and held + len(data) > INFLIGHT_BYTES:
                fut, n = pending.popleft()
                fut.result()
                held -= n
            pending.append((s.kv.write(key, data), len(data)))
            held += len(data)
            crcs.append(crc)
        while pending:
            pending.popleft()[0].result()
    except ShardkitError:
        raise
    except Exception as e:
        raise _error(loc, "writing the checkpoint's chunk objects", e, WriteError) from None
    return crcs


def publish_save(loc: Location, it: Path, manifest_json: str, generation: bytes) -> str:
    """Rank 0's end of a training save written straight to the store, once every rank's chunk objects are there:
    the iteration's other files from the local directory `it` (the arrays' zarr.json, train_state.json, hf/), then
    manifest.json, then `latest` (conditional on `generation`, what `unpublish` returned)."""
    store = ObjectStore(loc)
    name = it.name
    files = sorted(p for p in it.rglob("*") if p.is_file() and p != it / MANIFEST)
    store.upload([(p, f"{name}/{p.relative_to(it).as_posix()}") for p in files])
    fault_point("storage.objects")
    store.write(f"{name}/{MANIFEST}", manifest_json.encode())
    fault_point("storage.manifest")
    if not store.write(LATEST, f"{name}\n".encode(), if_equal=generation):
        raise WriteError(f"{loc.url}/{LATEST}: another writer moved it while {name} was being written; {name} is "
                         "complete on the store but not the latest")
    return f"{loc.url.rstrip('/')}/{name}"


# -- plan / launch: continue-pretrain command lines with s3:// / gs:// passed through ---------------------------------

def launch_view(cfg, check_load: bool):
    """The trainer configuration `shardkit launch` runs its start-up checks on, when --load / --save are on object
    storage: nothing is looked up on the local filesystem under a URL, and the rendered scripts keep the URLs.
    --save: its form and format (no torch_dist) checked here, then left out of the local output checks; --load:
    with `check_load` its small files (manifest, train state, hf/; no arrays) downloaded into a temporary
    directory, removed at exit, which the layout checks open; without, left out."""
    import atexit
    import dataclasses

    c = cfg.checkpoint
    load, save = c.load, c.save
    if save and parse(save, "--save") is not None:
        if c.save_format == "torch_dist":
            raise ShardkitError(f"--save {save}: " + TORCH_DIST_REFUSED.format(scheme=save.split(":")[0]))
        save = None
    if load and parse(load, "--load") is not None:
        if check_load:
            stack = contextlib.ExitStack()
            atexit.register(stack.close)
            try:
                load = stack.enter_context(reading(load, arrays=False, ranks=True))
            except ShardkitError as e:  # the line names the flag, as the trainer's own refusals do
                raise type(e)(f"--load {e}") from None
        else:
            load = None
    if (load, save) == (c.load, c.save):
        return cfg
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, load=load, save=save))


def resume_lines(load: str, save: str) -> str:
    """launch --requeue with --save on object storage: the shell lines that pick --load when the job (re)starts. A
    complete checkpoint at --save (`shardkit inspect` reads the store's manifest) resumes from it; a location
    without one (`not a shardkit checkpoint`) starts from --load; any other answer (credentials, network) stops the
    job, so a requeued job never restarts from --load over newer saves."""
    import shlex

    q = shlex.quote
    return ("# --requeue: a requeued (or resubmitted) job resumes from the newest complete checkpoint in --save\n"
            f"SHARDKIT_LOAD={q(load)}\n"
            f"if probe=$(\"${{SHARDKIT_PYTHON:-python3}}\" -m shardkit inspect {q(save)} 2>&1 >/dev/null); then\n"
            f"    SHARDKIT_LOAD={q(save)}\n"
            "elif [[ $probe != *'not a shardkit checkpoint'* ]]; then\n"
            f"    echo \"$0: cannot tell whether {save} holds a checkpoint: $probe\" >&2\n"
            "    exit 1\n"
            "fi\n")
