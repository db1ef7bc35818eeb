import pytest
import torch
from trainer_helpers import make_config


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny debug models run fastest on one thread, and on a busy 2-core machine
    two OpenMP threads per process can be 10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def cfg_factory(tmp_path):
    def f(name="llama3_debug", extra=(), job="run"):
        return make_config(tmp_path, name, extra, job)
    return f
