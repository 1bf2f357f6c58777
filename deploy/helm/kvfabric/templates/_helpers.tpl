{{- define "kvfabric.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfabric.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvfabric.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfabric.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvfabric.labels" -}}
{{ include "kvfabric.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: node-daemon
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvfabric.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvfabric.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvfabric.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvfabric.cluster" -}}
{{- eq .Values.mode "cluster" -}}
{{- end -}}

{{/* The Secret holding the admin token, and whether the chart makes it. */}}
{{- define "kvfabric.authSecret" -}}
{{- default (printf "%s-token" (include "kvfabric.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "kvfabric.clusterSecret" -}}
{{- default (printf "%s-cluster-secret" (include "kvfabric.fullname" .)) .Values.cluster.secret.existingSecret -}}
{{- end -}}

{{/* Where the Secrets are mounted in the daemon's container. */}}
{{- define "kvfabric.tokenFile" -}}
/etc/kvfabric-secret/{{ .Values.auth.key }}
{{- end -}}

{{- define "kvfabric.clusterSecretFile" -}}
/etc/kvfabric-cluster/{{ .Values.cluster.secret.key }}
{{- end -}}

{{/*
A Secret value: the one given, else the one the release's Secret already holds (so an
upgrade keeps it; `helm template` sees no cluster and makes a new one), else a random one.
Arguments: (list $ secretName key given).
*/}}
{{- define "kvfabric.secretValue" -}}
{{- $top := index . 0 -}}
{{- $name := index . 1 -}}
{{- $key := index . 2 -}}
{{- $given := index . 3 -}}
{{- if $given -}}
{{- $given | b64enc -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" $top.Release.Namespace $name -}}
{{- if and $existing (hasKey $existing.data $key) -}}
{{- index $existing.data $key -}}
{{- else -}}
{{- randAlphaNum 64 | b64enc -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The daemon's config (kvfabric.yaml), as YAML: what the values say, with `config` merged
over it. Checked against kvfabric's own loader by tests/integration/deploy.
*/}}
{{- define "kvfabric.config" -}}
{{- $cluster := eq .Values.mode "cluster" -}}
{{- $tiers := list -}}
{{- range .Values.tiers -}}
{{- $tier := deepCopy . -}}
{{- if and (has (toString $tier.kind) (list "dram" "cxl")) (not (hasKey $tier "huge_pages")) -}}
{{- $_ := set $tier "huge_pages" (ternary "on" "off" $.Values.hugepages.enabled) -}}
{{- end -}}
{{- $tiers = append $tiers $tier -}}
{{- end -}}
{{- $config := dict
  "socket_path" (printf "%s/kvfabric.sock" .Values.hostPaths.socket)
  "log_level" .Values.logLevel
  "http" (dict "host" "0.0.0.0" "port" (int .Values.http.port))
  "auth" (dict "token_file" (include "kvfabric.tokenFile" .))
  "store" (dict "data_dir" .Values.hostPaths.data "tiers" $tiers)
-}}
{{- if and $cluster (ge (float64 .Values.cluster.heartbeatSeconds) (float64 .Values.cluster.leaseTtlSeconds)) -}}
{{- fail "cluster.heartbeatSeconds must be shorter than cluster.leaseTtlSeconds" -}}
{{- end -}}
{{- if $cluster -}}
{{- /* tcp.host is the pod IP, from the environment (KVFABRIC_TCP__HOST): peers are told it */ -}}
{{- $_ := set $config "tcp" (dict "host" "0.0.0.0" "port" (int .Values.cluster.tcpPort)) -}}
{{- $index := dict
  "index" "redis"
  "lease_ttl_s" .Values.cluster.leaseTtlSeconds
  "heartbeat_s" .Values.cluster.heartbeatSeconds
  "hardware_class" .Values.cluster.hardwareClass
  "transport" .Values.cluster.transport
  "secret_file" (include "kvfabric.clusterSecretFile" .)
-}}
{{- if not .Values.cluster.redis.existingSecret -}}
{{- $_ := set $index "redis_url" (required "mode cluster needs cluster.redis.url (or cluster.redis.existingSecret)" .Values.cluster.redis.url) -}}
{{- end -}}
{{- $_ := set $config "cluster" $index -}}
{{- else -}}
{{- $_ := set $config "tcp" (dict "port" nil) -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite $config (deepCopy .Values.config)) -}}
{{- end -}}
