# The master and the brain: dlmaster, dlbrain. No torch.
#   docker build -f deploy/docker/master.Dockerfile -t dlfleet-master .
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto proto
COPY master master
COPY worker worker
COPY brain brain
COPY tools/protogen.py tools/protogen.py
RUN pip install --no-cache-dir ".[master,postgres,mysql,kubernetes]" \
 && rm -rf /src
USER 65532
ENTRYPOINT []
CMD ["dlmaster", "--help"]
