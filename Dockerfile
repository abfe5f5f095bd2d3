# CPU image. For CUDA hosts, build FROM an NVIDIA CUDA runtime image and install the
# matching torch build instead of the pinned CPU wheel (see constraints.txt).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DIFFSHARD_HOST=0.0.0.0
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY server ./server
RUN pip install --no-cache-dir -c constraints.txt . \
    --extra-index-url https://download.pytorch.org/whl/cpu
RUN useradd --create-home diffshard
USER diffshard
# 8000: the API (OpenAI Images API, health); 8001: Prometheus /metrics
EXPOSE 8000 8001
ENTRYPOINT ["python", "-m", "server"]
CMD ["serve"]
