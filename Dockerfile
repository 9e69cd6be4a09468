# arendez: the rendezvous/store server by default; the same image runs ranks (see docker-compose.yml).
# BASE_IMAGE: any image with python3.11 and pip on PATH. Without a registry, build one from Debian
# packages with scripts/build-base-image.sh and pass --build-arg BASE_IMAGE=localhost/arendez-base:bookworm.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

LABEL org.arendez.image="arendez"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir ".[metrics]" \
    && useradd --create-home --uid 10001 --user-group arendez
USER arendez

# 29400: rendezvous/store; 29480: /metrics, /status and the dashboard (http://host:29480/)
EXPOSE 29400 29480
# Healthy once the server accepts TCP connections (a bare connect and close; no name lookup).
HEALTHCHECK --interval=2s --timeout=3s --start-period=10s --retries=15 \
    CMD ["python", "-c", "import socket; socket.create_connection(('127.0.0.1', 29400), timeout=2).close()"]
CMD ["arendez-server", "--host", "0.0.0.0", "--port", "29400", "--http-host", "0.0.0.0", "--http-port", "29480"]
