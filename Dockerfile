# kvserve on the CPU. The default model is fetched into the volume on first start.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 KVSERVE_CACHE=/data/kvserve
WORKDIR /app

# g++ builds the AVX2 kernels (q4 weights, span attention) once, into the image
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# the CPU build of torch, pinned like pyproject.toml (a plain `torch` would pull a CUDA build)
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# EXTRAS=cluster (docker-compose's scale profile): vllm-router and the KV event publisher's packages,
# and nginx for session traffic
ARG EXTRAS=
RUN if [ -n "$EXTRAS" ]; then apt-get update && apt-get install -y --no-install-recommends nginx-light \
      && rm -rf /var/lib/apt/lists/*; fi

COPY pyproject.toml README.md ./
COPY kvcache ./kvcache
COPY models ./models
COPY server ./server
RUN pip install ".${EXTRAS:+[$EXTRAS]}" && kvserve kernels

VOLUME /data/kvserve
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"

CMD ["kvserve", "serve", "--model", "smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8000"]
