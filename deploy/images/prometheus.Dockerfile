# A local stand-in for the official prom/prometheus image, from Debian's prometheus package (2.42),
# built by scripts/build_images.sh on its Debian base: no registry. docker-compose.yml runs it
# through PROMETHEUS_IMAGE with the same command as the official image (flags only) and the same
# data folder (/prometheus, the working directory: its default storage path data/ lies in it).
ARG BASE
FROM ${BASE}
RUN install -d -o prometheus -g prometheus -m 0750 /prometheus
WORKDIR /prometheus
USER prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
