# A training image: dlworker, ShardedDataLoader, torch, and the examples.
# torch is installed first from the CPU index (a GPU image would start from a
# CUDA base and the matching wheel instead); no Kubernetes client.
#   docker build -f deploy/docker/train.Dockerfile -t dlfleet-train .
FROM python:3.11-slim
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto proto
COPY master master
COPY worker worker
COPY brain brain
COPY tools/protogen.py tools/protogen.py
RUN pip install --no-cache-dir ".[worker]" && rm -rf /src
WORKDIR /workspace
COPY examples examples
USER 65532
CMD ["dlworker", "--help"]
