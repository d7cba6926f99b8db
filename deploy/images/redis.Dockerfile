# A local stand-in for the official redis:7.0 image, from Debian's redis-server (7.0.x), built by
# scripts/build_images.sh on its Debian base: no registry. docker-compose.yml runs it through
# REDIS_IMAGE; its command there writes the password file and execs redis-server from /data.
ARG BASE
FROM ${BASE}
RUN install -d -o redis -g redis -m 0750 /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no", "--dir", "/data"]
