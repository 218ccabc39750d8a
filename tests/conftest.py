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


# The modules that take longest (most of their time in processes they start), longest first. `make test`
# hands whole modules to its two workers in collection order (--dist loadfile --no-loadscope-reorder), so
# these go out first and the run does not end on one worker finishing a long module while the other idles.
LONGEST_FIRST = [
    "test_data_cli.py", "test_pipeline.py", "test_pipeline_coordinators.py", "test_stream_real_shapes.py",
    "test_cli_convert.py", "test_tp.py", "test_tp_serve.py", "test_train_resume.py", "test_cli_shard.py",
    "test_serving_server.py", "test_stream_room.py", "test_cli_options.py", "test_front_generate.py",
    "test_serving_pass_memory.py", "test_quant_triton.py", "test_demo.py", "test_shard_experts.py",
    "test_stream_memory.py", "test_convert_safety.py", "test_data_train.py", "test_serving_serve_memory.py",
    "test_cli_repair.py", "test_cli_disk.py", "test_pipeline_streamed.py", "test_real_shapes_masked.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: the rest keep their order
