{{/* Name of the release's objects: <release> unless it already contains "weft". */}}
{{- define "weft.fullname" -}}
{{- if contains "weft" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-weft" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "weft.operator.name" -}}{{ include "weft.fullname" . }}-operator{{- end -}}
{{- define "weft.agent.name" -}}{{ include "weft.fullname" . }}-agent{{- end -}}

{{- define "weft.labels" -}}
app.kubernetes.io/name: weft
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "weft.operator.selector" -}}
app.kubernetes.io/name: weft
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "weft.agent.selector" -}}
app.kubernetes.io/name: weft
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end -}}

{{- define "weft.image" -}}
{{- $img := index .root.Values.images .which -}}
{{- printf "%s:%s" $img.repository (default .root.Chart.AppVersion $img.tag) -}}
{{- end -}}

{{/* The cluster's primary pod CIDR and its per-node prefix length: the IPv4
ones, or in an IPv6-only cluster (clusterCIDR null) the IPv6 ones. */}}
{{- define "weft.clusterCIDR" -}}
{{- .Values.network.clusterCIDR | default .Values.network.ipv6ClusterCIDR -}}
{{- end -}}
{{- define "weft.nodePrefixLength" -}}
{{- if .Values.network.clusterCIDR -}}{{ .Values.network.nodePrefixLength }}{{- else -}}{{ .Values.network.ipv6NodePrefixLength }}{{- end -}}
{{- end -}}
{{/* Where the metrics servers listen: every IPv4 address, or in an
IPv6-only cluster (whose probes and scrapes come over IPv6) every IPv6 one. */}}
{{/* Loopback (the probes' 127.0.0.1, there on IPv6-only nodes too) and the node IP (from WEFT_NODE_IP, set before) with a port, for the agent's listeners. */}}
{{- define "weft.localAddresses" -}}
{{- if .root.Values.network.clusterCIDR -}}127.0.0.1:{{ .port }},$(WEFT_NODE_IP):{{ .port }}
{{- else -}}127.0.0.1:{{ .port }},[$(WEFT_NODE_IP)]:{{ .port }}
{{- end -}}
{{- end -}}
{{- define "weft.anyAddress" -}}
{{- if .Values.network.clusterCIDR -}}0.0.0.0{{- else -}}[::]{{- end -}}
{{- end -}}
{{/* The node IP (WEFT_NODE_IP, set before) with a port: bracketed in an
IPv6-only cluster, whose node IPs are IPv6 addresses. */}}
{{- define "weft.nodeAddress" -}}
{{- if .root.Values.network.clusterCIDR -}}$(WEFT_NODE_IP):{{ .port }}
{{- else -}}[$(WEFT_NODE_IP)]:{{ .port }}
{{- end -}}
{{- end -}}
{{/* "true" when the flows API is on: it serves the agents' flow records, so
both flowsApi.enabled and agent.flows.enabled. */}}
{{- define "weft.flowsApi.enabled" -}}
{{- if and .Values.flowsApi.enabled .Values.agent.flows.enabled -}}true{{- end -}}
{{- end -}}
{{- define "weft.flowsApi.name" -}}{{ include "weft.fullname" . }}-flows-api{{- end -}}
{{/* "true" when the cluster is dual-stack: an IPv4 CIDR and an IPv6 one. */}}
{{- define "weft.dualStack" -}}
{{- if and .Values.network.clusterCIDR .Values.network.ipv6ClusterCIDR -}}true{{- end -}}
{{- end -}}

{{/* Checks that the schema cannot express; fails the render with a clear message. */}}
{{- define "weft.validate" -}}
{{- $n := .Values.network -}}
{{- if not (or $n.clusterCIDR $n.ipv6ClusterCIDR) -}}
{{- fail "set network.clusterCIDR (IPv4), network.ipv6ClusterCIDR with clusterCIDR null (IPv6-only), or both (dual-stack)" -}}
{{- end -}}
{{- with $n.clusterCIDR -}}
{{- $clusterPrefix := int (last (splitList "/" .)) -}}
{{- if le (int $n.nodePrefixLength) $clusterPrefix -}}
{{- fail (printf "network.nodePrefixLength (%d) must be longer than the prefix of network.clusterCIDR (%s)" (int $n.nodePrefixLength) .) -}}
{{- end -}}
{{- end -}}
{{- with $n.ipv6ClusterCIDR -}}
{{- $v6Prefix := int (last (splitList "/" .)) -}}
{{- if le (int $n.ipv6NodePrefixLength) $v6Prefix -}}
{{- fail (printf "network.ipv6NodePrefixLength (%d) must be longer than the prefix of network.ipv6ClusterCIDR (%s)" (int $n.ipv6NodePrefixLength) .) -}}
{{- end -}}
{{- if and $n.clusterCIDR (gt (int $n.ipv6NodePrefixLength) (sub 128 (sub 32 (int $n.nodePrefixLength)))) -}}
{{- fail (printf "network.ipv6NodePrefixLength (%d) leaves fewer IPv6 addresses per node than network.nodePrefixLength (%d) leaves IPv4 ones" (int $n.ipv6NodePrefixLength) (int $n.nodePrefixLength)) -}}
{{- end -}}
{{- end -}}
{{- if gt (int $n.hostPortRange.min) (int $n.hostPortRange.max) -}}
{{- fail (printf "network.hostPortRange.min (%d) must not exceed network.hostPortRange.max (%d)" (int $n.hostPortRange.min) (int $n.hostPortRange.max)) -}}
{{- end -}}
{{- $le := .Values.operator.leaderElection -}}
{{- if and $le.enabled (ge (int $le.renewDeadlineSeconds) (int $le.leaseDurationSeconds)) -}}
{{- fail (printf "operator.leaderElection.renewDeadlineSeconds (%d) must be below leaseDurationSeconds (%d)" (int $le.renewDeadlineSeconds) (int $le.leaseDurationSeconds)) -}}
{{- end -}}
{{- if and (gt (int .Values.operator.replicas) 1) (not $le.enabled) -}}
{{- fail "operator.replicas > 1 needs operator.leaderElection.enabled: two operators without a leader would allocate concurrently" -}}
{{- end -}}
{{- end -}}
