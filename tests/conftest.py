"""Fixtures every test module may use."""
import shutil

import pytest


@pytest.fixture(scope="module")
def module_tmp_path(tmp_path_factory, request):
    """A folder for one module's shared checkpoints and stores, removed once the module's tests are done, so
    that the suite holds the big ones one module at a time rather than all of them until it ends."""
    folder = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
