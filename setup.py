"""Build script: installs the `engine` and `parallel` packages and compiles the C++ dataset
index helpers in csrc/ with pybind11. Torch is deliberately absent from the build (see
pyproject.toml); install torch==2.13.0 first, then `pip install -e .`."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

helpers = Pybind11Extension(
    "engine.data._helpers",
    sources=["csrc/dataset_helpers.cpp"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)

setup(
    name="tripod",
    version="0.1.0",
    description="A Megatron-style 3D-parallel LLM training engine, from laptop CPU to GPU cluster",
    packages=find_packages(include=["engine", "engine.*", "parallel", "parallel.*", "tools"]),
    ext_modules=[helpers],
    cmdclass={"build_ext": build_ext},
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
    ],
)
