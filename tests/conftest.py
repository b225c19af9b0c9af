import hashlib
import os
import sys
from pathlib import Path

import pytest

# One thread per process, set before torch starts its pool; inherited by the subprocesses the tests start (CLI,
# servers, the Triton interpreter). The tiny models' matrices gain nothing from a second thread, and on a busy
# machine (or under pytest-xdist, a worker per core) a second thread that waits for a core costs several times the
# work itself.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"].split(",")[0]))


# Under pytest-xdist (-n N, its default --dist load): the tests of these modules share a module fixture too costly to
# build on every worker (the server processes of test_server.py and test_server_hostile.py, the interpreter
# subprocesses of test_folded_norm.py and the tree kernels' tests), so each module goes to one worker whole; every
# other test is scheduled on its own. (xdist's --dist loadgroup would say it with marks, but it groups nothing under
# pytest >= 9.2: github.com/pytest-dev/pytest-xdist/issues/1386.)
WHOLE_MODULES = ("test_server.py", "test_server_hostile.py", "test_folded_norm.py", "test_tree_attention_kernel.py",
                 "test_tree_build_kernel.py", "test_tree_gdn_kernel.py", "test_bench_scripts.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "load":
        return None  # another --dist asked for: xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        """One work unit per test, or per module of WHOLE_MODULES; the larger units first, then collection order."""

        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return module if module.rsplit("/", 1)[-1] in WHOLE_MODULES else nodeid

    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """In an xdist worker (whose collection order the scheduler follows): the slow tests first, so that no long test
    starts last on one worker while the others idle."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


class _Built:
    """Checkpoints built once per session (per xdist worker) for each distinct set of arguments, under the session's
    temporary directory. Shared by every test that asks with the same arguments: read them, never write them (copy
    first to corrupt one); the session's end checks that no file changed."""

    def __init__(self, tmp_path_factory):
        self.factory, self.paths, self.digests = tmp_path_factory, {}, {}

    def get(self, kind, build, key):
        if (kind, key) not in self.paths:
            directory = self.factory.mktemp(kind)
            build(directory)
            self.paths[kind, key] = directory
            self.digests[directory] = self.digest(directory)
        return self.paths[kind, key]

    @staticmethod
    def digest(directory):
        return {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}

    def check_unchanged(self):
        changed = [str(d) for d, digest in self.digests.items() if self.digest(d) != digest]
        assert not changed, f"a test wrote into a shared checkpoint (copy it first): {changed}"


def _key(kwargs):
    return tuple(sorted(kwargs.items()))


@pytest.fixture(scope="session")
def _built(tmp_path_factory):
    built = _Built(tmp_path_factory)
    yield built
    built.check_unchanged()


@pytest.fixture(scope="session")
def tiny_checkpoint(_built):
    """tiny_checkpoint(**kwargs) -> the directory of blockspec.fixtures.tiny.build_tiny_checkpoint(directory, **kwargs), built
    once per session for those arguments. Shared: do not modify it."""
    from blockspec.fixtures.tiny import build_tiny_checkpoint

    def get(**kwargs):
        kwargs = {"seed": 0, "planted": False, **kwargs}  # build_tiny_checkpoint's defaults, for the key
        return _built.get("tiny", lambda d: build_tiny_checkpoint(d, **kwargs), _key(kwargs))
    return get


@pytest.fixture(scope="session")
def tiny_drafter(_built):
    """tiny_drafter(target, **kwargs) -> the directory of blockspec.fixtures.tiny.build_tiny_drafter(directory, target,
    **kwargs), built once per session for that target and those arguments. Shared: do not modify it."""
    from blockspec.fixtures.tiny import build_tiny_drafter

    def get(target, **kwargs):
        kwargs = {"seed": 0, "window": 16, "noise": 0.0, **kwargs}  # build_tiny_drafter's defaults, for the key
        return _built.get("drafter", lambda d: build_tiny_drafter(d, target, **kwargs), (str(target), _key(kwargs)))
    return get
