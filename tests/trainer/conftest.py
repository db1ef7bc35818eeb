import pytest
from trainer_helpers import make_config


@pytest.fixture
def cfg_factory(tmp_path):
    def f(name="llama3_debug", extra=(), job="run"):
        return make_config(tmp_path, name, extra, job)
    return f
