#!/usr/bin/env bash
# Creates the hook server's TLS Secret (noctaya-system/noctaya-hooks-tls: tls.crt, tls.key, ca.crt)
# from a private CA made here, for the Service name Metacontroller dials. The controllers verify the
# hook server against ca.crt (their webhook caBundle). The hook server reloads the files when the
# Secret changes, so rerunning this (to renew) needs no restart; the controllers read ca.crt when they
# are created or updated, and each run makes a new CA: afterwards touch the controllers (docs/install.md).
# For automatic renewal prefer cert-manager: examples/security/hook-server-cert-manager.yaml.
#
#   tools/make-hook-cert.sh [NAMESPACE] [DAYS]      # defaults: noctaya-system 365
set -euo pipefail
ns="${1:-noctaya-system}"; days="${2:-365}"
host="noctaya-hooks.${ns}.svc"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
cd "$work"
openssl req -x509 -newkey rsa:3072 -nodes -days "$((days * 2))" -subj "/CN=noctaya-hooks-ca" \
  -keyout ca.key -out ca.crt 2>/dev/null
openssl req -newkey rsa:3072 -nodes -subj "/CN=${host}" -keyout tls.key -out tls.csr 2>/dev/null
printf 'subjectAltName=DNS:%s,DNS:%s.cluster.local\nextendedKeyUsage=serverAuth\n' "$host" "$host" > tls.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" -extfile tls.ext \
  -out tls.crt 2>/dev/null
kubectl -n "$ns" create secret generic noctaya-hooks-tls --type=kubernetes.io/tls \
  --from-file=tls.crt --from-file=tls.key --from-file=ca.crt --dry-run=client -o yaml | kubectl apply -f -
echo "noctaya-hooks-tls in ${ns}: certificate for ${host}, valid ${days} days"
