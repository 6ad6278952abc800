{{/* Names */}}
{{- define "failover.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "failover.fullname" -}}
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

{{- define "failover.selectorLabels" -}}
app.kubernetes.io/name: {{ include "failover.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "failover.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{ include "failover.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/*
Duration -> integer seconds. Accepts an integer (seconds) or "N", "Ns", "Nm", "Nh".
*/}}
{{- define "failover.seconds" -}}
{{- $v := toString . -}}
{{- if regexMatch "^[0-9]+$" $v -}}{{ $v }}
{{- else if regexMatch "^[0-9]+s$" $v -}}{{ trimSuffix "s" $v }}
{{- else if regexMatch "^[0-9]+m$" $v -}}{{ mul (trimSuffix "m" $v | atoi) 60 }}
{{- else if regexMatch "^[0-9]+h$" $v -}}{{ mul (trimSuffix "h" $v | atoi) 3600 }}
{{- else -}}{{ fail (printf "duration %q: use integer seconds or N[s|m|h]" $v) }}
{{- end -}}
{{- end -}}

{{- define "failover.modelLoadSeconds" -}}{{ include "failover.seconds" .Values.timeouts.modelLoadTimeout }}{{- end -}}
{{- define "failover.wakingSeconds" -}}{{ include "failover.seconds" .Values.timeouts.wakingTimeout }}{{- end -}}

{{- define "failover.supervisorStartSeconds" -}}{{ include "failover.seconds" .Values.timeouts.supervisorStartTimeout }}{{- end -}}

{{/*
Engine startup probe failureThreshold. /startup answers 200 once the supervisor is up (flags
valid, probes bound, lock reachable, engine spawned): seconds, not the model load, which the
supervisor bounds itself (--startup-timeout = modelLoadTimeout; /live answers 503 in Init after
it). kubelet kills at the failureThreshold-th consecutive failure, which happens
(failureThreshold - 1) * period after the first probe at the earliest. So
ceil(supervisorStartTimeout / period) + 1 guarantees (failureThreshold - 1) * period >=
supervisorStartTimeout.
*/}}
{{- define "failover.startupFailureThreshold" -}}
{{- $up := include "failover.supervisorStartSeconds" . | atoi -}}
{{- $load := include "failover.modelLoadSeconds" . | atoi -}}
{{- if ge $up $load }}{{ fail "timeouts.supervisorStartTimeout must be shorter than timeouts.modelLoadTimeout" }}{{ end -}}
{{- $p := int .Values.probes.startup.periodSeconds -}}
{{- add (div (add $up (sub $p 1)) $p) 1 -}}
{{- end -}}

{{/* Socket paths: the ONE place they are spelled. */}}
{{- define "failover.lockdSocket" -}}{{ printf "%s/lockd.sock" .Values.sockets.dir }}{{- end -}}
{{- define "failover.lockdEndpoint" -}}{{ printf "unix:%s" (include "failover.lockdSocket" .) }}{{- end -}}
{{- define "failover.lockdState" -}}{{ printf "%s/lockd.state" .Values.sockets.dir }}{{- end -}}
{{- define "failover.gmsSocket" -}}{{ printf "%s/gms-%d.sock" .root.Values.sockets.dir (int .device) }}{{- end -}}
{{- define "failover.gmsSockets" -}}
{{- $root := . -}}
{{- $out := list -}}
{{- range $i := until (int .Values.engine.tensorParallelSize) -}}
{{- $out = append $out (include "failover.gmsSocket" (dict "root" $root "device" $i)) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{/* The claim reference every GPU container carries. */}}
{{- define "failover.claimRef" -}}
claims:
  - name: {{ .Values.dra.requestName }}
{{- end -}}

{{- define "failover.socketMount" -}}
- name: sockets
  mountPath: {{ .Values.sockets.dir }}
{{- end -}}

{{/*
The engine command line (after supervisor's "--"). Context: dict root, engine (entry of
.Values.engine.engines).
*/}}
{{- define "failover.engineCommand" -}}
{{- $v := .root.Values -}}
{{- $e := .engine -}}
{{- if eq $v.engine.adapter "vllm" }}
- vllm
- serve
- {{ $v.engine.model | quote }}
- --enable-sleep-mode
- --host
- "127.0.0.1"
- --port
- {{ $e.enginePort | quote }}
- --tensor-parallel-size
- {{ $v.engine.tensorParallelSize | quote }}
{{- else if eq $v.engine.adapter "sglang" }}
- python3
- -m
- sglang.launch_server
- --model-path
- {{ $v.engine.model | quote }}
- --enable-memory-saver
- --host
- "127.0.0.1"
- --port
- {{ $e.enginePort | quote }}
- --tp-size
- {{ $v.engine.tensorParallelSize | quote }}
{{- else }}
{{- fail (printf "engine.adapter must be vllm or sglang, not %q" $v.engine.adapter) }}
{{- end }}
{{- range $v.engine.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
