"""Whether GPU_FLAGS can get GPUs from a Docker engine, decided from `docker info` and the CDI specs on disk."""

import json

from stackproof.images import gpu_runtime

NO_TOOLKIT = {"Runtimes": {"runc": {}}, "CDISpecDirs": []}


def absent(_program):
    return False


def test_no_flags_need_nothing():
    assert gpu_runtime.problem("", NO_TOOLKIT, on_path=absent) is None


def test_gpus_without_the_toolkit_say_expected_found_and_fix():
    message = gpu_runtime.problem("--gpus all", NO_TOOLKIT, on_path=absent)
    assert "expected nvidia-container-runtime-hook on the host" in message
    assert "found no nvidia-container-runtime-hook on PATH, runtimes runc" in message
    assert "fix: install the NVIDIA Container Toolkit" in message


def test_gpus_with_the_toolkit_pass():
    assert gpu_runtime.problem("--gpus all", NO_TOOLKIT, on_path=lambda p: p == gpu_runtime.RUNTIME_HOOK) is None
    with_runtime = {"Runtimes": {"runc": {}, "nvidia": {}}, "CDISpecDirs": []}
    assert gpu_runtime.problem('--gpus "device=0,1"', with_runtime, on_path=absent) is None


def test_cdi_devices_are_looked_up_in_the_engines_spec_dirs(tmp_path):
    info = {"Runtimes": {"runc": {}}, "CDISpecDirs": [str(tmp_path)]}
    assert "knows no CDI kind nvidia.com/gpu" in gpu_runtime.problem("--device nvidia.com/gpu=all", info,
                                                                      on_path=absent)
    (tmp_path / "nvidia.yaml").write_text('---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: "0"\n')
    assert gpu_runtime.problem("--device nvidia.com/gpu=all", info, on_path=absent) is None
    (tmp_path / "nvidia.yaml").unlink()
    (tmp_path / "nvidia.json").write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu"}))
    assert gpu_runtime.problem("--device=nvidia.com/gpu=0", info, on_path=absent) is None


def test_a_missing_runtime_is_named():
    assert "asks for the runtime 'nvidia'" in gpu_runtime.problem("--runtime=nvidia", NO_TOOLKIT, on_path=absent)
