{{/* Names and labels, as `helm create` spells them. */}}
{{- define "expertd.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "expertd.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* The headless Service of sharded mode; pods are <fullname>-<i>.<this>. */}}
{{- define "expertd.headless" -}}
{{- printf "%s-headless" (include "expertd.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "expertd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "expertd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "expertd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "expertd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "expertd.checkValues" -}}
{{- if not (has .Values.mode (list "single" "sharded")) }}
{{- fail (printf "mode %q: want single or sharded" .Values.mode) }}
{{- end }}
{{- if and (eq .Values.mode "sharded") (lt (int .Values.sharded.shards) 1) }}
{{- fail "sharded.shards: want >= 1" }}
{{- end }}
{{- if not (has .Values.sharded.placement (list "contiguous" "round-robin")) }}
{{- fail (printf "sharded.placement %q: want contiguous or round-robin" .Values.sharded.placement) }}
{{- end }}
{{- if and .Values.manifest.sets (not .Values.weights.volume) }}
{{- fail "manifest.sets needs weights.volume: the sets load from it" }}
{{- end }}
{{- end }}

{{/* The startup manifest (cmd/expertd/manifest.go), as JSON. */}}
{{- define "expertd.manifest" -}}
{{- $m := dict "sets" .Values.manifest.sets }}
{{- if eq .Values.mode "sharded" }}
{{- $_ := set $m "shard" (dict "count" (int .Values.sharded.shards) "placement" .Values.sharded.placement) }}
{{- end }}
{{- if .Values.manifest.waitForFiles }}
{{- $_ := set $m "waitForFiles" .Values.manifest.waitForFiles }}
{{- end }}
{{- toPrettyJson $m }}
{{- end }}

{{/* The pod template, shared by the Deployment and the StatefulSet. */}}
{{- define "expertd.podTemplate" -}}
metadata:
  labels:
    {{- include "expertd.selectorLabels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- if .Values.manifest.sets }}
    checksum/manifest: {{ include "expertd.manifest" . | sha256sum }}
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  containers:
    - name: expertd
      image: "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - -listen=0.0.0.0:{{ .Values.ports.grpc }}
        - -admin-addr=0.0.0.0:{{ .Values.ports.metrics }}
        - -backend={{ .Values.backend }}
        - -shutdown-timeout={{ .Values.shutdownTimeout }}
        {{- if .Values.weights.volume }}
        - -weights-dir={{ .Values.weights.mountPath }}
        {{- end }}
        {{- if .Values.manifest.sets }}
        - -manifest=/etc/expertd/manifest.json
        {{- end }}
        {{- if .Values.tls.secretName }}
        - -tls-cert=/etc/expertd/tls/tls.crt
        - -tls-key=/etc/expertd/tls/tls.key
        {{- end }}
        {{- if .Values.tls.clientCASecretName }}
        - -tls-client-ca=/etc/expertd/client-ca/ca.crt
        {{- end }}
        {{- with .Values.tls.adminIdentities }}
        - -admin-identities={{ join "," . }}
        {{- end }}
        {{- if .Values.auth.tokensSecretName }}
        - -auth-tokens-file=/etc/expertd/auth/tokens
        {{- end }}
        {{- range .Values.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        {{- if eq .Values.mode "sharded" }}
        # The shard is the pod's ordinal: the pod-index label (Kubernetes
        # >= 1.28), else the daemon reads it from the host name.
        - name: EXPERTD_SHARD_INDEX
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
        {{- end }}
        {{- with .Values.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ .Values.ports.grpc }}
          protocol: TCP
        - name: metrics
          containerPort: {{ .Values.ports.metrics }}
          protocol: TCP
      startupProbe:
        httpGet:
          path: /readyz
          port: metrics
        {{- toYaml .Values.probes.startup | nindent 8 }}
      livenessProbe:
        httpGet:
          path: /livez
          port: metrics
        {{- toYaml .Values.probes.liveness | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /readyz
          port: metrics
        {{- toYaml .Values.probes.readiness | nindent 8 }}
      resources:
        {{- $res := deepCopy (.Values.resources | default dict) }}
        {{- if gt (int .Values.gpus) 0 }}
        {{- $limits := merge (dict "nvidia.com/gpu" (int .Values.gpus)) ($res.limits | default dict) }}
        {{- $_ := set $res "limits" $limits }}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
        {{- if .Values.weights.volume }}
        - name: weights
          mountPath: {{ .Values.weights.mountPath }}
          readOnly: true
        {{- end }}
        {{- if .Values.manifest.sets }}
        - name: manifest
          mountPath: /etc/expertd/manifest.json
          subPath: manifest.json
          readOnly: true
        {{- end }}
        {{- if .Values.tls.secretName }}
        - name: tls
          mountPath: /etc/expertd/tls
          readOnly: true
        {{- end }}
        {{- if .Values.tls.clientCASecretName }}
        - name: client-ca
          mountPath: /etc/expertd/client-ca
          readOnly: true
        {{- end }}
        {{- if .Values.auth.tokensSecretName }}
        - name: auth
          mountPath: /etc/expertd/auth
          readOnly: true
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {}
    {{- if .Values.weights.volume }}
    - name: weights
      {{- toYaml .Values.weights.volume | nindent 6 }}
    {{- end }}
    {{- if .Values.manifest.sets }}
    - name: manifest
      configMap:
        name: {{ include "expertd.fullname" . }}-manifest
    {{- end }}
    {{- if .Values.tls.secretName }}
    - name: tls
      secret:
        secretName: {{ .Values.tls.secretName }}
    {{- end }}
    {{- if .Values.tls.clientCASecretName }}
    - name: client-ca
      secret:
        secretName: {{ .Values.tls.clientCASecretName }}
    {{- end }}
    {{- if .Values.auth.tokensSecretName }}
    - name: auth
      secret:
        secretName: {{ .Values.auth.tokensSecretName }}
        # The daemon warns about token files others may read.
        defaultMode: 0400
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
