# syntax=docker/dockerfile:1
# Build:  docker build -t inference-cost-exporter .
# Run:    docker run -p 9877:9877 -v $PWD/config.yaml:/etc/inference-cost-exporter/config.yaml:ro \
#           -e BILLING_ACCESS_KEY_ID -e BILLING_SECRET_ACCESS_KEY -e INFERENCE_API_KEY inference-cost-exporter

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter ./exporter
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/inference-cost-exporter exporter
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl && rm -rf /wheels
USER 10001
# The SQLite state (alert state, notification outbox, usage cursor) lives here: mount a volume to keep it.
WORKDIR /var/lib/inference-cost-exporter
EXPOSE 9877
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:9877/healthz', timeout=4).status != 200)"]
ENTRYPOINT ["inference-cost-exporter", "run"]
CMD ["--config", "/etc/inference-cost-exporter/config.yaml"]
