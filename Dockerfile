# Argus image: the official Ray image (Ray 2.57.1, Python 3.11) plus the `app` package.
# KubeRay (kuberay/*.yaml) runs it as head, worker and job-submitter; it needs no CMD.
#
#   docker build -t ghcr.io/argus/argus:0.1.0 .                     # CUDA image (default)
#   docker build --build-arg RAY_VARIANT=cpu \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu \
#       -t ghcr.io/argus/argus:0.1.0-cpu .                          # CPU-only image
ARG RAY_VERSION=2.57.1
ARG RAY_VARIANT=gpu
FROM rayproject/ray:${RAY_VERSION}-py311-${RAY_VARIANT}

# ARGs declared before FROM are not visible after it; re-declare to use them below.
ARG RAY_VERSION
# Extra pip index for torch wheels, e.g. the CPU-only index for the cpu variant
# (PyPI's default Linux torch wheels bundle CUDA, ~2.5 GB we do not want on CPU nodes).
ARG TORCH_INDEX=""

# COPY before WORKDIR: WORKDIR would create the directory as root, and the in-tree
# build (egg-info, build/) must be writable by the image's non-root `ray` user.
COPY --chown=ray:users . /home/ray/argus
WORKDIR /home/ray/argus

# Ray is pinned in the same resolve so that no dependency can swap the image's Ray
# for another release: head, workers and rayVersion must all agree.
RUN pip install --no-cache-dir ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
        . "ray[data,train,serve]==${RAY_VERSION}"

ENV PYTHONUNBUFFERED=1
# Serve's throughput mode without direct ingress (app/cluster.py: SERVE_ENV; a test keeps them equal).
ENV RAY_SERVE_THROUGHPUT_OPTIMIZED=1 \
    RAY_SERVE_ENABLE_DIRECT_INGRESS=0 \
    RAY_SERVE_PROXY_USE_GRPC=1
