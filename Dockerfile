# syntax=docker/dockerfile:1
# MaxText images: one target per device, each with the pinned requirements files and this repository.
#   docker build --target cpu -t maxtext:cpu .    # requirements.txt (jax for CPU)
#   docker build --target tpu -t maxtext:tpu .    # + requirements-tpu.txt (libtpu)
#   docker build --target gpu -t maxtext:gpu .    # + requirements-gpu.txt (jax[cuda12]: CUDA, cuDNN, NCCL wheels)
#   docker run --rm maxtext:cpu                   # the cpu/smoke recipe (20 tiny steps); arguments replace it:
#   docker run --rm maxtext:cpu MaxText/configs/base.yml run_name=r steps=5 ...   # train.py's arguments
# BASE_IMAGE: any image with Python >= 3.12 and its venv module (default python:3.12-slim-bookworm).
# Used by multihost_job.py --PLATFORM=jobset/vertex --IMAGE=... and multihost_runner.py --IMAGE=...
# (docs/multihost.md, "Container images").
ARG BASE_IMAGE=python:3.12-slim-bookworm

FROM ${BASE_IMAGE} AS base
# A venv, not the system Python: Debian's python3 refuses `pip install` outside one (PEP 668).
RUN python3 -m venv /opt/venv
# PYTHONPATH: `from MaxText import ...` from the copied repository (or a folder mounted over it), as setup.sh's
# editable install gives it.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/maxtext \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /maxtext
# The requirements first, alone: the install layer is rebuilt only when they change, not with every code edit.
COPY requirements.txt ./
RUN pip install -r requirements.txt

FROM base AS cpu
COPY . .
ENTRYPOINT ["python3", "MaxText/train.py"]
CMD ["cpu/smoke"]

FROM base AS tpu
COPY requirements-tpu.txt ./
RUN pip install -r requirements-tpu.txt
COPY . .
ENTRYPOINT ["python3", "MaxText/train.py"]
CMD ["cpu/smoke", "hardware=tpu"]

FROM base AS gpu
COPY requirements-gpu.txt ./
RUN pip install -r requirements-gpu.txt
COPY . .
ENTRYPOINT ["python3", "MaxText/train.py"]
CMD ["cpu/smoke", "hardware=gpu"]
