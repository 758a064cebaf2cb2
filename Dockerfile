# syntax=docker/dockerfile:1
# Build:  docker build -t inference-cost-exporter .
# Run:    docker run -p 9877:9877 -v $PWD/config.yaml:/etc/inference-cost-exporter/config.yaml:ro \
#           -e BILLING_ACCESS_KEY_ID -e BILLING_SECRET_ACCESS_KEY -e INFERENCE_API_KEY inference-cost-exporter

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY exporter ./exporter
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
# The commit the image is built from, for inference_exporter_build_info{revision}:
#   docker build --build-arg REVISION=$(git rev-parse HEAD) -t inference-cost-exporter .
ARG REVISION=unknown
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 INFERENCE_COST_EXPORTER_REVISION=$REVISION
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/inference-cost-exporter exporter
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl && rm -rf /wheels
USER 10001
# The SQLite state (alert state, notification outbox, usage cursor) lives here: mount a volume to keep it.
WORKDIR /var/lib/inference-cost-exporter
EXPOSE 9877
# The health check asks the exporter's own /healthz from inside the container. It follows
# HEALTHCHECK_URL, so set it when you change `server.listen` or enable `server.tls`, e.g.
#   docker run -e HEALTHCHECK_URL=https://127.0.0.1:9443/healthz ...
# An https URL is checked WITHOUT verifying the certificate (an unverified SSL context, for this
# check only): it only asks the process in this container over loopback whether it is up, and a
# self-signed or internally issued certificate must not make a healthy exporter "unhealthy".
# /healthz is never behind `server.basic_auth`, so the check needs no credentials. Anything but a
# 200 (an error status, a refused connection, a timeout) exits non-zero: unhealthy.
ENV HEALTHCHECK_URL=http://127.0.0.1:9877/healthz
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, ssl, sys, urllib.request; url = os.environ.get('HEALTHCHECK_URL') or 'http://127.0.0.1:9877/healthz'; unverified = ssl.create_default_context(); unverified.check_hostname = False; unverified.verify_mode = ssl.CERT_NONE; sys.exit(urllib.request.urlopen(url, timeout=4, context=unverified).status != 200)"]
ENTRYPOINT ["inference-cost-exporter", "run"]
CMD ["--config", "/etc/inference-cost-exporter/config.yaml"]
