package target

import (
	"slices"
	"testing"
)

// An APTPL file as LIO writes it (core_scsi3_update_aptpl_buf), with the
// NUL it ends with: the holder's registration and another.
const aptplSample = `PR_REG_START: 0
initiator_fabric=iSCSI
initiator_node=iqn.2003-01.io.berth:node-a
initiator_sid=00023d010000
sa_res_key=12963195208651793036
res_holder=1
res_type=05
res_scope=00
res_all_tg_pt=0
mapped_lun=1
target_fabric=iSCSI
target_node=iqn.2003-01.io.berth:fence
tpgt=1
port_rtpi=1
target_lun=1
PR_REG_END: 0
PR_REG_START: 1
initiator_fabric=iSCSI
initiator_node=iqn.2003-01.io.berth:node-a
initiator_sid=00023d020000
sa_res_key=12963195208651793036
res_holder=0
res_all_tg_pt=0
mapped_lun=1
target_fabric=iSCSI
target_node=iqn.2003-01.io.berth:fence
tpgt=2
port_rtpi=2
target_lun=1
PR_REG_END: 1
` + "\x00"

func TestAPTPLRegistrations(t *testing.T) {
	got := aptplRegistrations(aptplSample)
	want := []string{
		"initiator_fabric=iSCSI,initiator_node=iqn.2003-01.io.berth:node-a,initiator_sid=00023d010000,sa_res_key=12963195208651793036,res_holder=1,res_type=05,res_scope=00,res_all_tg_pt=0,mapped_lun=1,target_fabric=iSCSI,target_node=iqn.2003-01.io.berth:fence,tpgt=1,port_rtpi=1,target_lun=1",
		"initiator_fabric=iSCSI,initiator_node=iqn.2003-01.io.berth:node-a,initiator_sid=00023d020000,sa_res_key=12963195208651793036,res_holder=0,res_all_tg_pt=0,mapped_lun=1,target_fabric=iSCSI,target_node=iqn.2003-01.io.berth:fence,tpgt=2,port_rtpi=2,target_lun=1",
	}
	if !slices.Equal(got, want) {
		t.Errorf("aptplRegistrations:\n got %q\nwant %q", got, want)
	}
	for _, f := range []string{"No Registrations or Reservations\n\x00", ""} {
		if got := aptplRegistrations(f); len(got) != 0 {
			t.Errorf("aptplRegistrations(%q) = %q, want none", f, got)
		}
	}
}
