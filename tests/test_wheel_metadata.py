"""torch's wheel metadata is read the way pip reads it, with `packaging`: wheel names parsed and matched against
the image's tags, and each Requires-Dist marker evaluated for the image's Python and platform."""

from packaging.tags import Tag

from stackproof.images import metadata

METADATA = """Metadata-Version: 2.1
Name: torch
Version: 2.14.1
Requires-Dist: filelock
Requires-Dist: nvidia-nccl-cu13==2.30.7; platform_system == "Linux"
Requires-Dist: pywin32; sys_platform == "win32"
Requires-Dist: nvidia-cufile==1.15.1.6; platform_system == "Linux" and platform_machine == "x86_64"
Requires-Dist: nvidia-arm-only==1.0; platform_machine == "aarch64"
Requires-Dist: tomli; python_version < "3.11"
Requires-Dist: opt-einsum>=3.3; extra == "opt-einsum"
"""


def test_requirements_are_those_whose_markers_hold_in_the_image():
    assert sorted(metadata.requirements(METADATA, "3.13")) == ["filelock", "nvidia-cufile", "nvidia-nccl-cu13"]
    assert sorted(metadata.requirements(METADATA, "3.10")) == ["filelock", "nvidia-cufile", "nvidia-nccl-cu13",
                                                               "tomli"]


def test_the_image_tags_are_cpython_on_manylinux_x86_64():
    tags = metadata.supported_tags("3.13")
    assert Tag("cp313", "cp313", "manylinux_2_28_x86_64") in tags
    assert Tag("cp313", "cp313", "manylinux2014_x86_64") in tags
    assert Tag("py3", "none", "manylinux_2_12_x86_64") in tags
    assert Tag("py3", "none", "any") in tags
    assert Tag("cp312", "cp312", "manylinux_2_28_x86_64") not in tags
    assert Tag("cp313", "cp313", "manylinux_2_34_x86_64") not in tags  # newer than the images' glibc floor
    assert Tag("cp313", "cp313", "manylinux_2_28_aarch64") not in tags
    assert Tag("cp313", "cp313", "musllinux_1_2_x86_64") not in tags
