#!/usr/bin/env bash
# Creates the two Secrets examples/security/scaler-mtls.yaml references, from a throwaway CA.
# For production prefer cert-manager (rotation); this shows exactly which keys go where.
#   examples/security/make-scaler-certs.sh NAMESPACE LLMSERVICE
set -euo pipefail
ns="${1:?namespace}"; svc="${2:?llmservice name}"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
cd "$work"
# The scaler Service KEDA dials: <llmservice>-scaler.<namespace>.svc (see `kubectl get svc`).
host="${svc}-scaler.${ns}.svc"

openssl req -x509 -newkey rsa:3072 -nodes -days 365 -subj "/CN=noctaya-scaler-ca" -keyout ca.key -out ca.crt
openssl req -newkey rsa:3072 -nodes -subj "/CN=${host}" -keyout server.key -out server.csr
printf 'subjectAltName=DNS:%s,DNS:%s.cluster.local\nextendedKeyUsage=serverAuth\n' "$host" "$host" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -extfile server.ext -out server.crt
openssl req -newkey rsa:3072 -nodes -subj "/CN=keda-operator" -keyout client.key -out client.csr
printf 'extendedKeyUsage=clientAuth\n' > client.ext
openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -extfile client.ext -out client.crt

# One CA signs both sides here, so each side's ca.crt is the same file.
kubectl -n "$ns" create secret generic "${svc}-scaler-tls" --type=kubernetes.io/tls \
  --from-file=tls.crt=server.crt --from-file=tls.key=server.key --from-file=ca.crt=ca.crt
kubectl -n "$ns" create secret generic keda-scaler-client \
  --from-file=tls.crt=client.crt --from-file=tls.key=client.key --from-file=ca.crt=ca.crt
