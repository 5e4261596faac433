# SPDX-License-Identifier: Apache-2.0
"""The devices the plan-equivalence scripts plan for (DeviceFacts fields), by name: the H200 and
H100 SXM (132 SMs), the H100 PCIe (114), Hopper without Gluon, Blackwell (sm_100), Ampere
(sm_80), a ROCm GPU and the interpreter (CPU)."""

DEVICES = {
    "h200": dict(kind="cuda", num_sms=132, capability=(9, 0), gluon_hopper=True),
    "h100-pcie": dict(kind="cuda", num_sms=114, capability=(9, 0), gluon_hopper=True),
    "hopper-no-gluon": dict(kind="cuda", num_sms=132, capability=(9, 0), gluon_hopper=False),
    "sm100": dict(kind="cuda", num_sms=148, capability=(10, 0), gluon_hopper=True),
    "sm80": dict(kind="cuda", num_sms=108, capability=(8, 0), gluon_hopper=False),
    "hip": dict(kind="cuda", num_sms=304, capability=(9, 4), gluon_hopper=False, hip=True),
    "cpu": dict(kind="cpu", num_sms=4, capability=(0, 0), gluon_hopper=False),
}
