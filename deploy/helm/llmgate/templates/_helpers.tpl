{{/* Names, labels and the bits the gateway and worker templates share. */}}

{{- define "llmgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llmgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "llmgate.gatewayName" -}}
{{- printf "%s-gateway" (include "llmgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llmgate.workerName" -}}
{{- printf "%s-worker" (include "llmgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The headless Service: its DNS name lists every worker pod. */}}
{{- define "llmgate.workersServiceName" -}}
{{- printf "%s-workers" (include "llmgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* What the gateway's --workers names: one DNS name per pool, one worker per pod IP. */}}
{{- define "llmgate.workersAddress" -}}
{{- $addresses := list }}
{{- range $pool := include "llmgate.pools" . | fromYamlArray }}
{{- $service := printf "%s%s" (include "llmgate.workersServiceName" $) (ternary (printf "-%s" $pool.name) "" (not (empty $pool.name))) }}
{{- $addresses = append $addresses (printf "tcp://%s.%s.svc.%s:%d" $service $.Release.Namespace $.Values.clusterDomain (int $.Values.worker.port)) }}
{{- end }}
{{- join "," $addresses }}
{{- end }}

{{/* The pools as a YAML list: `pools`, or one unnamed pool of `worker`. */}}
{{- define "llmgate.pools" -}}
{{- if .Values.pools }}
{{- toYaml .Values.pools }}
{{- else }}
{{- toYaml (list (dict "name" "")) }}
{{- end }}
{{- end }}

{{/* The label that tells one pool's worker pods from another's (none without pools). */}}
{{- define "llmgate.poolLabel" -}}
{{- with .name }}
llmgate.io/pool: {{ . | quote }}
{{- end }}
{{- end }}

{{/* The gateway's pools file (shared/config.py): pools, aliases, auto. */}}
{{- define "llmgate.poolsConfig" -}}
{{- $pools := list }}
{{- range .Values.pools }}
{{- $p := dict "name" .name "tier" (int (default 1 .tier)) }}
{{- with .servedModelName }}{{ $_ := set $p "served_model_name" . }}{{ end }}
{{- if hasKey . "spillAfter" }}{{ $_ := set $p "spill_after" .spillAfter }}{{ end }}
{{- with .substituteFor }}{{ $_ := set $p "substitute_for" . }}{{ end }}
{{- $pools = append $pools $p }}
{{- end }}
{{- $config := dict "pools" $pools }}
{{- with .Values.aliases }}{{ $_ := set $config "aliases" . }}{{ end }}
{{- with .Values.auto }}{{ $_ := set $config "auto" . }}{{ end }}
{{- toYaml $config }}
{{- end }}

{{- define "llmgate.poolsConfigDir" -}}/etc/llmgate/config{{- end }}

{{- define "llmgate.secretName" -}}
{{- default (printf "%s-secrets" (include "llmgate.fullname" .)) .Values.secrets.existingSecret }}
{{- end }}

{{- define "llmgate.hasApiKeys" -}}
{{- if .Values.secrets.existingSecret }}
{{- if .Values.secrets.existingSecretProvides.apiKeys }}true{{ end }}
{{- else if or .Values.secrets.apiKeys .Values.secrets.metricsToken }}true{{ end }}
{{- end }}

{{- define "llmgate.hasCurve" -}}
{{- $c := .Values.secrets.curve }}
{{- if .Values.secrets.existingSecret }}
{{- if .Values.secrets.existingSecretProvides.curve }}true{{ end }}
{{- else if and $c.gatewayKey $c.gatewayKeySecret $c.workerKey $c.workerKeySecret }}true{{ end }}
{{- end }}

{{/*
Where the Secret's files are mounted, and the settings that point at them.
These LLMGATE_* names are GatewaySettings/WorkerSettings fields
(shared/settings.py; shared/curve_keys.py says who holds which key): keep them in step.
*/}}
{{- define "llmgate.secretsDir" -}}/etc/llmgate/secrets{{- end }}
{{/* Workers accept the gateways whose public keys (*.key) are in this directory. */}}
{{- define "llmgate.gatewayKeysDir" -}}/etc/llmgate/gateway-keys{{- end }}

{{- define "llmgate.gatewaySecretEnv" -}}
{{- $dir := include "llmgate.secretsDir" . }}
{{- if include "llmgate.hasApiKeys" . }}
LLMGATE_API_KEYS_FILE: {{ printf "%s/api-keys" $dir | quote }}
{{- end }}
{{- if include "llmgate.hasCurve" . }}
LLMGATE_CURVE_GATEWAY_KEY_FILE: {{ printf "%s/gateway.key_secret" $dir | quote }}
LLMGATE_CURVE_WORKER_PUBLIC_KEY_FILE: {{ printf "%s/worker.key" $dir | quote }}
{{- end }}
{{- end }}

{{- define "llmgate.workerSecretEnv" -}}
{{- if include "llmgate.hasCurve" . }}
LLMGATE_CURVE_WORKER_KEY_FILE: {{ printf "%s/worker.key_secret" (include "llmgate.secretsDir" .) | quote }}
LLMGATE_CURVE_GATEWAY_KEYS_DIR: {{ include "llmgate.gatewayKeysDir" . | quote }}
{{- end }}
{{- end }}

{{- define "llmgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "llmgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels; call with (dict "root" $ "component" "gateway"). */}}
{{- define "llmgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llmgate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "llmgate.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* LLMGATE_<NAME> entries of a settings map (keys may use - or _). */}}
{{- define "llmgate.settingsEnv" -}}
{{- range $key, $value := . }}
{{ printf "LLMGATE_%s" (upper (replace "-" "_" $key)) }}: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/*
The shared state store (uploaded files, batch jobs, stored responses): where the
gateway's LLMGATE_STATE_DB comes from, as {name, key} of a Secret, or nothing
(no store: each gateway keeps SQLite in its own state directory).
*/}}
{{- define "llmgate.stateDbSecretRef" -}}
{{- $db := .Values.state.database }}
{{- if $db.url }}
name: {{ include "llmgate.stateDbSecretName" . }}
key: url
{{- else if $db.existingSecret }}
name: {{ $db.existingSecret }}
key: {{ $db.key }}
{{- else if .Values.postgresql.enabled }}
name: {{ include "llmgate.postgresqlName" . }}
key: url
{{- end }}
{{- end }}

{{- define "llmgate.stateDbSecretName" -}}
{{- printf "%s-state-db" (include "llmgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llmgate.postgresqlName" -}}
{{- printf "%s-postgresql" (include "llmgate.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fails the render on a store setting that cannot work. */}}
{{- define "llmgate.validateState" -}}
{{- $db := .Values.state.database }}
{{- $g := .Values.gateway }}
{{- if and $db.url $db.existingSecret }}
{{- fail "llmgate: state.database.url and state.database.existingSecret are both set; set one (the URL in a Secret of the chart's, or a Secret of yours holding it)" }}
{{- end }}
{{- if and .Values.postgresql.enabled (or $db.url $db.existingSecret) }}
{{- fail "llmgate: state.database is set, so the gateways use that PostgreSQL and the chart's demo one (postgresql.enabled, on by default) would sit unused: set postgresql.enabled=false" }}
{{- end }}
{{- if and (not (include "llmgate.stateDbSecretRef" .)) (or $g.autoscaling.enabled (gt (int $g.replicas) 1)) }}
{{- fail (printf "llmgate: %s gateway replicas need a shared state store (uploaded files, batch jobs and stored responses), or each pod would keep its own: set state.database.url (a postgresql:// URL), or state.database.existingSecret and state.database.key (a Secret holding the URL), or postgresql.enabled=true (a demo PostgreSQL in the chart); or run one gateway (gateway.autoscaling.enabled=false, gateway.replicas=1)" (ternary "autoscaled" (toString $g.replicas) $g.autoscaling.enabled)) }}
{{- end }}
{{- end }}
