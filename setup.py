"""Build script: installs the `engine` and `parallel` packages and compiles the C++ dataset
index helpers in csrc/ with pybind11. Torch is deliberately absent from the build requirements
(see pyproject.toml); install torch==2.13.0 first, then `pip install -e .`.

The fused CUDA kernels (csrc/fused) are built here only when the build can import a CUDA build
of torch and find the CUDA toolkit (`pip install --no-build-isolation -e .` on a GPU machine);
otherwise engine/ops compiles them on first use.
"""

import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup


def cuda_extension():
    """(extension, build_ext class) for csrc/fused, or None where CUDA is not available."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return None
    if not torch.version.cuda or CUDA_HOME is None or os.environ.get("TRIPOD_NO_CUDA_BUILD"):
        return None
    sources = ["bindings.cpp", "norms.cu", "rope.cu", "swiglu.cu", "cross_entropy.cu"]
    extension = CUDAExtension(
        "tripod_fused",
        [os.path.join("csrc", "fused", s) for s in sources],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
    )
    return extension, BuildExtension


helpers = Pybind11Extension(
    "engine.data.indexed._helpers",
    sources=["csrc/dataset_helpers.cpp"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)

extensions, build_class = [helpers], build_ext
cuda = cuda_extension()
if cuda is not None:
    extensions.append(cuda[0])
    build_class = cuda[1]

setup(
    name="tripod",
    version="0.1.0",
    description="A Megatron-style 3D-parallel LLM training engine, from laptop CPU to GPU cluster",
    # Only the importable library. tools/ (scripts run as `python tools/<name>.py` from a
    # checkout) and tests/ stay out: a top-level `tools` package would collide with others.
    packages=find_packages(include=["engine", "engine.*", "parallel", "parallel.*"]),
    package_data={"engine.config.megatron": ["*.tsv"]},  # Megatron-LM's flag lists
    ext_modules=extensions,
    cmdclass={"build_ext": build_class},
    python_requires=">=3.10",
    install_requires=[
        # torch is installed first and pinned by the Makefile (torch==2.13.0, or the GPU machine's
        # own build); listing it here would let pip resolve a multi-GB CUDA build by itself.
        "numpy==2.4.6",
        "pyarrow==26.0.1",
        "safetensors==0.8.0",
        "sentencepiece==0.2.3",
        "tqdm==4.70.1",
        "tensorboard==2.21.0",
        "zstandard==0.25.0",
        "xxhash==3.6.0",
    ],
)
